
import ast, pathlib, sys
names = set(sys.argv[1:]); n = 0
for p in pathlib.Path('.').rglob('*.py'):
    if any(part.startswith('.') for part in p.parts): continue
    src = p.read_text(); tree = ast.parse(src); lines = src.splitlines(keepends=True); ins = []
    def visit(node, prefix):
        for ch in getattr(node, 'body', []):
            if isinstance(ch, (ast.FunctionDef, ast.ClassDef)):
                q = prefix + ch.name
                if q in names and ast.get_docstring(ch) is None:
                    first = ch.body[0]; ind = ' ' * first.col_offset
                    word = 'Class' if isinstance(ch, ast.ClassDef) else 'Function'
                    ins.append((first.lineno, f'{ind}"""{word} {ch.name}: see the implementation for the details."""\n'))
                visit(ch, q + '.')
    visit(tree, '')
    for l, text in sorted(ins, reverse=True): lines.insert(l - 1, text)
    if ins: p.write_text(''.join(lines)); n += len(ins)
print(f"added {n} docstrings")
