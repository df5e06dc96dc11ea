
import io, pathlib, tokenize, sys
old, new = sys.argv[1], sys.argv[2]; n = 0
for p in pathlib.Path('.').rglob('*.py'):
    if any(part.startswith('.') for part in p.parts): continue
    text = p.read_text(); lines = text.splitlines(keepends=True)
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME and t.string == old]
    for t in reversed(toks):
        l, c = t.start; lines[l - 1] = lines[l - 1][:c] + new + lines[l - 1][c + len(old):]
    if toks: p.write_text(''.join(lines)); n += len(toks)
print(f"renamed {n} occurrences")
