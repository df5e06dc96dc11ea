
import difflib, pathlib, re, sys
log = pathlib.Path(sys.argv[1]).read_text(); fixed = []
mk = pathlib.Path('Makefile')
if mk.exists():
    t = mk.read_text(); lines = t.splitlines(keepends=True)
    for i in range(1, len(lines)):
        if re.match(r'^ {2,}\S', lines[i]) and (lines[i - 1].startswith('\t') or re.match(r'^[\w.-]+\s*:', lines[i - 1])):
            lines[i] = '\t' + lines[i].lstrip(' '); fixed.append('tab')
    t = ''.join(lines)
    targets = re.findall(r'^([\w.-]+)\s*:', t, re.M); defined = re.findall(r'^(\w+)\s*[?:+]?=', t, re.M)
    for v in set(re.findall(r'\$\((\w+)\)', t)) - set(defined):
        c = difflib.get_close_matches(v, defined, 1)
        if c: t = t.replace(f'$({v})', f'$({c[0]})'); fixed.append('var ' + v)
    for bad in re.findall(r"No rule to make target '([^']+)'", log):
        c = difflib.get_close_matches(bad, targets, 1)
        if c:
            t = re.sub(rf'(?<=[\s:]){re.escape(bad)}(?=\s|$)', c[0], t)
            for f in pathlib.Path('.').glob('*.sh'): f.write_text(re.sub(rf'make {re.escape(bad)}\b', f'make {c[0]}', f.read_text()))
            fixed.append('target ' + bad)
    mk.write_text(t)
pp = pathlib.Path('pyproject.toml')
if pp.exists():
    import tomllib
    t = pp.read_text()
    try: tomllib.loads(t)
    except tomllib.TOMLDecodeError:
        t = ''.join(l[:-1] + '"\n' if l.count('"') % 2 else l for l in t.splitlines(keepends=True)); fixed.append('toml quotes')
    if 'no tests found' in log:
        t = re.sub(r'pattern = "[^"]*"', 'pattern = "test_*.py"', t); fixed.append('pattern')
    pp.write_text(t)
print('fixed:', ', '.join(fixed) or 'nothing')
