
import ast, pathlib
n = 0
for p in pathlib.Path('.').rglob('*.py'):
    if any(part.startswith('.') for part in p.parts): continue
    src = p.read_text(); lines = src.splitlines(keepends=True)
    try: tree = ast.parse(src)
    except SyntaxError: continue
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)) and isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not):
            seg = ast.get_source_segment(src, node.test)
            if seg and seg.startswith('not (') and seg.endswith(')'):
                edits.append((node.test.lineno, node.test.col_offset, node.test.end_lineno, node.test.end_col_offset, seg[5:-1]))
    if not edits: continue
    off = [0]
    for l in lines: off.append(off[-1] + len(l.encode()))
    b = src.encode()
    for l1, c1, l2, c2, rep in sorted(edits, reverse=True):
        b = b[:off[l1 - 1] + c1] + rep.encode() + b[off[l2 - 1] + c2:]
    p.write_bytes(b); n += len(edits)
print(f"reverted {n} suspicious inverted conditions")
