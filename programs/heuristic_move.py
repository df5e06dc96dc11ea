
import ast, pathlib, sys
func, newmod = sys.argv[1], sys.argv[2]
for p in sorted(pathlib.Path('.').glob('*.py')):
    src = p.read_text(); tree = ast.parse(src); lines = src.splitlines(keepends=True)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func), None)
    if fn is None: continue
    imports = ''.join(lines[n.lineno - 1] for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno == n.end_lineno)
    start = fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno
    pathlib.Path(newmod + '.py').write_text(imports + '\n\n' + ''.join(lines[start - 1:fn.end_lineno]))
    p.write_text(''.join(lines[:start - 1]) + f'from {newmod} import {func}\n' + ''.join(lines[fn.end_lineno:]))
    print(f"moved {func} from {p} to {newmod}.py"); break
else: print(f"{func} not found")
