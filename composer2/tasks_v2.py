from __future__ import annotations
import ast, dataclasses, hashlib, io, json, re, statistics, tarfile, time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .env_base import program_text
from .io import sha256_text
from .tasks_data import CATEGORIES, HIDDEN, Task, TaskError, unified_diff
from .tasks_grade import validate_task
from .tasks_mutate import Mutation, _docstring_node, area, check_mutation, debug_prompt, find_mutations, mutate
from .tasks_gen import DEVOPS_BREAKS, Source, _find_qual, strip_docstrings
@dataclass
class Repo:
    "A codebase v2 tasks are built from: workspace files, hidden test files (paths under `HIDDEN`) and how to run them."
    name: str                      # short name used in task ids ('textwrap', 'cachetools')
    codebase: str                  # 'stdlib' or 'cachetools-5.5.0'
    licence: str
    files: dict[str, str]          # the code the agent sees
    tests: dict[str, str]          # the project's own tests (hidden)
    test_modules: list[str]
    import_checks: dict[str, str]  # module -> workspace path it must load from
    package: str                   # the importable name to hide on the host ('textwrap', 'cachetools')
    source_sha256: dict[str, str] = field(default_factory=dict)
    test_files: dict[str, str] = field(default_factory=dict)   # module file -> visible test file path for tests/devops tasks
    @classmethod
    def from_stdlib(cls, module: str, root=None) -> 'Repo':
        s = Source.load(module, root)
        return cls(module, 'stdlib', 'PSF-2.0', {s.rel: s.text}, {f'{s.test_module}.py': s.test_text}, [s.test_module],
                   {module: s.rel}, module, {s.rel: sha256_text(s.text), s.test_rel: sha256_text(s.test_text)},
                   {s.rel: f'tests/{s.test_module}.py'})
    def mod_of(self, rel: str) -> str:
        "The importable module name of workspace file `rel`."
        return rel[:-3].replace('/', '.').removesuffix('.__init__')
    def base(self, **kw) -> dict:
        d = dict(modules=[self.package], files=dict(self.files), hidden_tests=dict(self.tests), test_modules=list(self.test_modules),
                 import_checks=dict(self.import_checks), source=self.codebase, source_files=sorted(self.source_sha256),
                 source_sha256=dict(self.source_sha256))
        d.update(kw); return d

def repo_from_sdist(tar_path, package: str, licence: str, skip_tests=()) -> Repo:
    """A `Repo` from a pinned sdist, read in memory: the package's files (from `src/<pkg>/` or `<pkg>/`) at the workspace
    root, its `tests/` as the hidden package `c2t_<pkg>` (only unittest tests are run)."""
    tar_path = Path(tar_path); files, tests, sha = {}, {}, {}
    hp = f'c2t_{package}'
    with tarfile.open(tar_path) as tf:
        for m in tf.getmembers():
            if not m.isfile() or not m.name.endswith('.py'): continue
            rel = m.name.split('/', 1)[1]
            text = tf.extractfile(m).read().decode()
            if rel.startswith(f'src/{package}/'): rel = rel[4:]
            if rel.startswith(f'{package}/'): files[rel] = text; sha[rel] = sha256_text(text)
            elif rel.startswith('tests/') and rel.count('/') == 1:
                stem = Path(rel).stem
                if stem in skip_tests: continue
                text = re.sub(r'^(\s*)from tests(\.| import)', rf'\1from {hp}\2', text, flags=re.M)
                tests[f'{hp}/{Path(rel).name}'] = text; sha[rel] = sha256_text(text)
    if f'{package}/__init__.py' not in files: raise TaskError(f"{tar_path.name}: no package '{package}' in the sdist")
    tests.setdefault(f'{hp}/__init__.py', '')
    mods = sorted(f'{hp}.{Path(p).stem}' for p in tests if Path(p).name.startswith('test') and p.endswith('.py'))
    if not mods: raise TaskError(f"{tar_path.name}: no tests/test_*.py in the sdist")
    name = tar_path.name.removesuffix('.tar.gz')
    return Repo(package, name, licence, files, tests, mods, {package: f'{package}/__init__.py'}, package, sha)
_STUB = 'raise NotImplementedError'

def _defs(tree):
    "(qualname, node, class-or-None) of top-level functions, classes and methods."
    out = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)): out.append((n.name, n, None))
        elif isinstance(n, ast.ClassDef):
            out.append((n.name, n, None))
            out += [(f'{n.name}.{m.name}', m, n) for m in n.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return out

def _stub_edit(lines, q, fn):
    "A Mutation replacing the body of `fn` (after its docstring) by `raise NotImplementedError`, or None if not on own lines."
    body = fn.body[1:] if _docstring_node(fn) is not None else fn.body
    if not body or body[0].lineno <= fn.lineno or (len(body) == 1 and isinstance(body[0], ast.Raise)): return None
    first = body[0].lineno
    if any(lines[i].rstrip().endswith('\\') for i in range(first - 1, fn.end_lineno)): return None
    if lines[first - 1].strip().startswith(('"', "'")) and _docstring_node(fn) is None: return None
    ind = lines[first - 1][:len(lines[first - 1]) - len(lines[first - 1].lstrip())]
    end = (fn.end_lineno + 1, 0) if fn.end_lineno < len(lines) else (fn.end_lineno, len(lines[-1]))
    return Mutation('remove_body', q, first, (first, 0), end, ind + _STUB + '\n')

def _stub(text, picks):
    "`text` with the bodies of `picks` [(qualname, node)] stubbed; (new text, stubbed names, removed lines) or None."
    lines = text.splitlines(keepends=True); edits = [e for q, fn in picks if (e := _stub_edit(lines, q, fn))]
    if not edits: return None
    try: out = mutate(text, edits)
    except (SyntaxError, TaskError): return None
    return out, [e.func for e in edits], sum(e.end[0] - e.start[0] for e in edits)

def _pyfiles(repo, min_lines=40):
    return [r for r in sorted(repo.files) if r.endswith('.py') and repo.files[r].count('\n') >= min_lines]

def _pick(rng, seq, k): return rng.sample(seq, min(k, len(seq)))

def gen_feature_class(repo: Repo, rng, n: int = 2, lo: int = 60, hi: int = 450) -> list[Task]:
    "Every method of one class stubbed (signatures and docstrings kept): implement the class again."
    cands = []
    for rel in _pyfiles(repo):
        tree = ast.parse(repo.files[rel])
        for c in tree.body:
            if not isinstance(c, ast.ClassDef) or c.name.startswith('_'): continue
            ms = [(f'{c.name}.{m.name}', m) for m in c.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            r = _stub(repo.files[rel], ms)
            if r and len(r[1]) >= 3 and lo <= r[2] <= hi: cands.append((rel, c.name, r))
    out = []
    for rel, cname, (text, names, nl) in _pick(rng, cands, n):
        a = area(repo.name)
        prompt = rng.choice([f"`{cname}` in our {a} code is only a skeleton now: every method raises NotImplementedError. Please implement the class again; the docstrings and the rest of the code show what it must do.",
                             f"Someone gutted `{cname}` ({a}) and left stubs that raise NotImplementedError. We need the class working again, consistent with how the rest of the package uses it.",
                             f"Half of {a} is broken because `{cname}` has no implementation any more (all methods are stubs). Can you write it?"])
        out.append(Task(id=f'{repo.name}-feature_class', category='feature', prompt=prompt, solution={rel: repo.files[rel]},
                        **repo.base(files={**repo.files, rel: text}, metadata={'template': 'feature_class', 'functions': names, 'kinds': ['feature_class']})))
    return out

def gen_feature_funcs(repo: Repo, rng, n: int = 2, min_total: int = 80, max_total: int = 320) -> list[Task]:
    "The bodies of several documented functions of one file stubbed until 80+ lines are gone: implement them."
    out = []
    files = _pyfiles(repo, 120); rng.shuffle(files)
    for rel in files:
        if len(out) >= n: break
        text = repo.files[rel]; lines = text.splitlines(keepends=True)
        fs = [(q, fn) for q, fn, _ in _defs(ast.parse(text)) if isinstance(fn, ast.FunctionDef) and not fn.name.startswith('__')
              and _docstring_node(fn) is not None and (e := _stub_edit(lines, q, fn)) and e.end[0] - e.start[0] >= 6]
        rng.shuffle(fs); pick, tot = [], 0
        for q, fn in fs:
            e = _stub_edit(lines, q, fn); k = e.end[0] - e.start[0]
            if tot + k > max_total: continue
            pick.append((q, fn)); tot += k
            if tot >= min_total or len(pick) >= 8: break
        if tot < min_total * 0.6 or len(pick) < 2: continue
        r = _stub(text, pick)
        if not r: continue
        lst = ', '.join(f'`{x}`' for x in r[1][:6]) + (' and more' if len(r[1]) > 6 else '')
        a = area(repo.name)
        prompt = rng.choice([f"Several functions in our {a} code were stubbed out during a migration and raise NotImplementedError ({lst}). Please implement them again from their docstrings.",
                             f"After a bad merge {lst} in {a} only raise NotImplementedError. Bring them back so everything that depends on them works again."])
        out.append(Task(id=f'{repo.name}-feature_funcs', category='feature', prompt=prompt, solution={rel: text},
                        **repo.base(files={**repo.files, rel: r[0]}, metadata={'template': 'feature_funcs', 'functions': r[1], 'kinds': ['feature_funcs']})))
    return out

def gen_feature_module(repo: Repo, rng, n: int = 1, lo: int = 60, hi: int = 700) -> list[Task]:
    "A whole module (every function and method) stubbed: implement it from its docstrings and the tests' expectations."
    cands = []
    for rel in _pyfiles(repo, 60):
        text = repo.files[rel]
        defs = [(q, fn) for q, fn, _ in _defs(ast.parse(text)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))]
        r = _stub(text, defs)
        if r and lo <= r[2] <= hi and len(r[1]) >= 3: cands.append((rel, r))
    out = []
    for rel, (text, names, nl) in _pick(rng, cands, n):
        mod = repo.mod_of(rel); a = area(repo.name)
        prompt = rng.choice([f"Only the skeleton of `{mod}` is left: every function in it raises NotImplementedError. Please write the implementation again; docstrings and callers say what each piece must do.",
                             f"We need `{mod}` ({a}) implemented. The signatures and docs are there but every body is a NotImplementedError stub."])
        out.append(Task(id=f'{repo.name}-feature_module', category='feature', prompt=prompt, solution={rel: repo.files[rel]},
                        **repo.base(files={**repo.files, rel: text}, metadata={'template': 'feature_module', 'functions': names, 'kinds': ['feature_module']})))
    return out
import builtins as _builtins

def _module_level_loads(tree, skip) -> set:
    "Names loaded by module-level code (class bodies and bases included, function bodies not), outside the nodes in `skip`."
    out = set()
    def visit(n):
        if n in skip: return
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for d in getattr(n, 'decorator_list', []) + [x for x in n.args.defaults + n.args.kw_defaults if x]: visit(d)
            return
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load): out.add(n.id)
        for c in ast.iter_child_nodes(n): visit(c)
    visit(tree); return out

def _free_names(nodes) -> set:
    loads, local = set(), set()
    for node in nodes:
        for x in ast.walk(node):
            if isinstance(x, ast.Name): (loads if isinstance(x.ctx, ast.Load) else local).add(x.id)
            elif isinstance(x, ast.arg): local.add(x.arg)
            elif isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): local.add(x.name)
            elif isinstance(x, (ast.Global, ast.Nonlocal)): return None
    return loads - local - set(dir(_builtins))

def _move(repo: Repo, rel: str, names: list[str], new_rel: str) -> dict | None:
    "Move top-level `names` from `rel` into the new module `new_rel` (imports it needs added), re-exported by `rel`: the gold files."
    text = repo.files[rel]; tree = ast.parse(text); lines = text.splitlines(keepends=True)
    nodes = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    if len(nodes) != len(names): return None
    if _module_level_loads(tree, set(nodes)) & set(names): return None
    free = _free_names(nodes)
    if free is None: return None
    free -= set(names)
    imported = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == node.end_lineno and not (isinstance(node, ast.ImportFrom) and node.module == '__future__'):
            for al in node.names: imported[(al.asname or al.name).split('.')[0]] = lines[node.lineno - 1]
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | \
              {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    if free - set(imported) - defined: return None
    orig_mod = repo.mod_of(rel); new_mod = repo.mod_of(new_rel)
    head = sorted({imported[x] for x in free if x in imported})
    rest = sorted(x for x in free if x not in imported)
    if rest: head.append(f"from {orig_mod} import {', '.join(rest)}\n")
    spans = sorted(((n.decorator_list[0].lineno if n.decorator_list else n.lineno), n.end_lineno) for n in nodes)
    body = '\n\n'.join(''.join(lines[a - 1:b]) for a, b in spans)
    fut = 'from __future__ import annotations\n' if 'from __future__ import annotations' in text else ''
    new_text = f'"""{", ".join(names)}: split out of `{orig_mod}`, which re-exports {"them" if len(names) > 1 else "it"}."""\n' + fut + ''.join(head) + '\n\n' + body + '\n'
    keep = [l for i, l in enumerate(lines, 1) if not any(a <= i <= b for a, b in spans)]
    after = re.sub(r'\n{4,}', '\n\n\n', ''.join(keep)).rstrip('\n') + f"\n\nfrom {new_mod} import {', '.join(names)}  # noqa: E402  (re-exported)\n"
    return {rel: after, new_rel: new_text}

def _move_check(repo, rel, new_rel, names) -> str:
    return program_text('struct_head.py') + program_text('check_move_v2.py', REL=repr(rel), NAMES=repr(names),
                                                         ORIG=repr(repo.mod_of(rel)), NEW=repr(repo.mod_of(new_rel)))

def _new_rel(repo, rel, tag):
    "The file of a new module next to `rel`: `pkg/_tag.py` in a package, `module_tag.py` at the top level."
    return f"{rel.rsplit('/', 1)[0]}/_{tag}.py" if '/' in rel else f"{Path(rel).stem}_{tag}.py"

def gen_move_class(repo: Repo, rng, n: int = 2, lo: int = 40) -> list[Task]:
    "Move one big class into a new module of its own, keeping every import of it working."
    cands = []
    for rel in _pyfiles(repo, 80):
        for c in ast.parse(repo.files[rel]).body:
            if isinstance(c, ast.ClassDef) and not c.name.startswith('_') and c.end_lineno - c.lineno + 1 >= lo: cands.append((rel, c.name))
    out = []
    rng.shuffle(cands)
    for rel, cname in cands:
        if len(out) >= n: break
        new_rel = _new_rel(repo, rel, cname.lower())
        gold = _move(repo, rel, [cname], new_rel)
        if not gold: continue
        nm = repo.mod_of(new_rel); om = repo.mod_of(rel)
        prompt = rng.choice([f"`{om}` has grown too big. Please move `{cname}` into a new module `{nm}`; everything that imports it from `{om}` today must keep working.",
                             f"As a first step of splitting up {area(repo.name)}, `{cname}` should live in its own module `{nm}`. Don't break existing imports or behaviour."])
        hidden = {**repo.tests, 'test_c2_structure.py': _move_check(repo, rel, new_rel, [cname])}
        out.append(Task(id=f'{repo.name}-move_class', category='refactor', prompt=prompt, solution=gold,
                        **repo.base(hidden_tests=hidden, test_modules=repo.test_modules + ['test_c2_structure'],
                                    metadata={'template': 'move_class', 'moved': [cname], 'new_module': nm, 'kinds': ['move_class']})))
    return out

def gen_split_module(repo: Repo, rng, n: int = 2, min_lines: int = 100) -> list[Task]:
    "Move a group of 3-8 public functions (60+ lines) into a new module, re-exported by the old one."
    out = []
    files = _pyfiles(repo, 150); rng.shuffle(files)
    for rel in files * 2:
        if len(out) >= n: break
        tree = ast.parse(repo.files[rel])
        used = _module_level_loads(tree, set())
        fs = [f for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith('_') and f.name not in used]
        if len(fs) < 4: continue
        i = rng.randrange(len(fs)); pick = []
        for f in fs[i:] + fs[:i]:
            pick.append(f.name)
            if sum(g.end_lineno - g.lineno + 1 for g in fs if g.name in pick) >= min_lines and len(pick) >= 3 or len(pick) >= 8: break
        tag = pick[0].lower().strip('_')[:20] + '_tools'
        new_rel = _new_rel(repo, rel, tag)
        if new_rel in repo.files or any(t.solution.get(new_rel) for t in out): continue
        gold = _move(repo, rel, pick, new_rel)
        if not gold: continue
        nm = repo.mod_of(new_rel); om = repo.mod_of(rel)
        lst = ', '.join(f'`{x}`' for x in pick)
        prompt = rng.choice([f"Please split `{om}`: {lst} belong together and should move to a new module `{nm}`. Callers that import them from `{om}` must keep working.",
                             f"`{om}` is hard to navigate. Move {lst} into `{nm}` (new), keep the public API of `{om}` unchanged."])
        hidden = {**repo.tests, 'test_c2_structure.py': _move_check(repo, rel, new_rel, pick)}
        out.append(Task(id=f'{repo.name}-split_module', category='refactor', prompt=prompt, solution=gold,
                        **repo.base(hidden_tests=hidden, test_modules=repo.test_modules + ['test_c2_structure'],
                                    metadata={'template': 'split_module', 'moved': pick, 'new_module': nm, 'kinds': ['split_module']})))
    return out

_BUG_KINDS = ['op_change', 'op_swap', 'invert_condition', 'off_by_one', 'constant_change', 'remove_statement']

def _bugs(text, rng, k, kinds=None, exclude=()):
    "`k` checked mutations of `text` in different functions (None if fewer exist)."
    muts = find_mutations(text, kinds or _BUG_KINDS); rng.shuffle(muts)
    pick, funcs = [], set(exclude)
    for m in muts:
        if len(pick) >= k: break
        if m.func in funcs or m.func.rsplit('.', 1)[-1].startswith('__') and m.func.endswith('__') and 'init' not in m.func: continue
        if any(not (m.end < p.start or p.end < m.start) for p in pick): continue
        if check_mutation(text, m): pick.append(m); funcs.add(m.func)
    return pick if len(pick) == k else None

def _debug_task(repo, template, broken: dict, muts: dict) -> Task:
    return Task(id=f'{repo.name}-{template}', category='debug', prompt='', solution={r: repo.files[r] for r in broken},
                **repo.base(files={**repo.files, **broken}, metadata={'template': template, 'kinds': [template],
                            'mutations': [{**dataclasses.asdict(m), 'file': r} for r, ms in muts.items() for m in ms]}))

def gen_debug_multi(repo: Repo, rng, n: int = 2, k=(3, 4, 5)) -> list[Task]:
    "3-5 bugs in different functions of one file."
    out = []
    for rel in _pick(rng, _pyfiles(repo, 80), n):
        ms = _bugs(repo.files[rel], rng, rng.choice(list(k)))
        if ms: out.append(_debug_task(repo, 'debug_multi', {rel: mutate(repo.files[rel], ms)}, {rel: ms}))
    return out

def gen_debug_blocks(repo: Repo, rng, n: int = 2) -> list[Task]:
    "2-3 missing blocks (a loop or an `if` branch dropped) plus one subtle bug, in one file."
    out = []
    for rel in _pick(rng, _pyfiles(repo, 80), n):
        t = repo.files[rel]
        big = [m for m in find_mutations(t, ['remove_loop', 'remove_condition']) if m.end[0] - m.start[0] >= 4]
        ms = _bugs(t, rng, rng.choice([2, 3]), ['remove_loop', 'remove_condition']) if len(big) < 2 else \
             [m for m in _pick(rng, big, 3) if check_mutation(t, m)]
        ms = [m for i, m in enumerate(ms or []) if all(m.func != x.func and (m.end < x.start or x.end < m.start) for x in ms[:i])]
        if len(ms) < 2: continue
        if not ms: continue
        extra = _bugs(t, rng, 1, ['op_change', 'invert_condition'], exclude={m.func for m in ms}) or []
        try: out.append(_debug_task(repo, 'debug_blocks', {rel: mutate(t, ms + extra)}, {rel: ms + extra}))
        except (SyntaxError, TaskError): continue
    return out

def gen_debug_cross_file(repo: Repo, rng, n: int = 2) -> list[Task]:
    "Bugs spread over 2-3 files of a package (one or two in each)."
    files = _pyfiles(repo, 40)
    if len(files) < 2: return []
    out = []
    for _ in range(n):
        rels = _pick(rng, files, rng.choice([2, 3])); broken, muts = {}, {}
        for r in rels:
            ms = _bugs(repo.files[r], rng, rng.choice([1, 2]))
            if ms: broken[r] = mutate(repo.files[r], ms); muts[r] = ms
        if len(broken) >= 2: out.append(_debug_task(repo, 'debug_cross_file', broken, muts))
    return out
def _doc_targets(text, min_doc=40):
    tree = ast.parse(text); lines = text.splitlines(keepends=True)
    out = []
    for q, fn, cls in _defs(tree):
        if any(p.startswith('_') for p in q.split('.')): continue
        d = _docstring_node(fn)
        if d is None or len(fn.body) < 2 or len(ast.get_docstring(fn) or '') < min_doc: continue
        a, b = lines[d.lineno - 1], lines[d.end_lineno - 1]
        if a[:d.col_offset].strip() or b[d.end_col_offset:].strip(): continue
        out.append((q, d))
    return out

def _docs_task(repo, rel, pick, template, prompt) -> Task | None:
    text = repo.files[rel]
    edits = [Mutation('remove_docstring', q, d.lineno, (d.lineno, 0), (d.end_lineno + 1, 0), '') for q, d in pick]
    try: broken = mutate(text, edits)
    except (SyntaxError, TaskError): return None
    names = sorted(q for q, _ in pick)
    want = strip_docstrings(ast.parse(text))
    check = program_text('struct_head.py') + program_text('strip_docstrings.py') + program_text('check_docs.py', TARGETS=repr(names), REL=repr(rel), WANT=repr(want))
    return Task(id=f'{repo.name}-{template}', category='docs', prompt=prompt, solution={rel: text},
                **repo.base(files={**repo.files, rel: broken}, hidden_tests={**repo.tests, 'test_c2_docs.py': check},
                            test_modules=repo.test_modules + ['test_c2_docs'], metadata={'template': template, 'targets': names, 'kinds': [template]}))

def gen_docs_module(repo: Repo, rng, n: int = 1, lo: int = 5, hi: int = 60, min_lines: int = 80) -> list[Task]:
    "Every public docstring of one module is gone: document the module's API again."
    out = []
    for rel in _pick(rng, [r for r in _pyfiles(repo) if lo <= len(_doc_targets(repo.files[r])) <= hi], n):
        mod = repo.mod_of(rel)
        p = rng.choice([f"`help()` on anything in `{mod}` shows nothing: the docstrings of its whole public API are gone. Please document every public function, class and method again (what it does, arguments, return value, errors). Code must stay as it is.",
                        f"Our API reference for `{mod}` is empty because the module lost its docstrings. Write them again for all public names, without touching the code."])
        if (t := _docs_task(repo, rel, _doc_targets(repo.files[rel]), 'docs_module', p)) and changed_lines_v2(t.gold_patch) >= min_lines: out.append(t)
    return out

def gen_docs_class(repo: Repo, rng, n: int = 2, min_lines: int = 50) -> list[Task]:
    "A public class and all its public methods lost their docstrings."
    groups = []
    for rel in _pyfiles(repo):
        ts = _doc_targets(repo.files[rel]); classes = {q for q, _ in ts if '.' not in q}
        for c in classes:
            g = [(q, d) for q, d in ts if q == c or q.startswith(c + '.')]
            if len(g) >= 3: groups.append((rel, c, g))
    out = []
    for rel, c, g in _pick(rng, groups, n):
        p = rng.choice([f"The docs page for `{c}` is blank: the class and its methods have no docstrings. Please write good ones (behaviour, parameters, return values, exceptions) without changing any code.",
                        f"Please document `{c}` in {area(repo.name)} properly again; someone stripped all of its docstrings. No code changes."])
        if (t := _docs_task(repo, rel, g, 'docs_class', p)) and changed_lines_v2(t.gold_patch) >= min_lines: out.append(t)
    return out

def gen_docs_api(repo: Repo, rng, n: int = 2, k=(8, 20), min_lines: int = 100) -> list[Task]:
    "8-14 public functions/methods of a big module without docstrings."
    out = []
    for rel in _pick(rng, [r for r in _pyfiles(repo) if len(_doc_targets(repo.files[r])) >= k[0]], n):
        ts = _doc_targets(repo.files[rel]); rng.shuffle(ts); pick, tot = [], 0
        for q, d in ts:
            pick.append((q, d)); tot += d.end_lineno - d.lineno + 1
            if len(pick) >= k[0] and tot >= min_lines or len(pick) >= k[1]: break
        lst = ', '.join(f'`{q}`' for q, _ in sorted(pick)[:5])
        p = rng.choice([f"Our generated docs for {area(repo.name)} have holes: {lst} and several others show no description. Find every public function in that module that lacks a docstring and write one. Don't change behaviour.",
                        f"Docs pass needed: a number of public functions in {area(repo.name)} ({lst}, ...) have no docstring. Add clear ones for all of them, code unchanged."])
        if (t := _docs_task(repo, rel, pick, 'docs_api', p)): out.append(t)
    return out
_MUT_KINDS = ['op_change', 'invert_condition', 'remove_statement', 'constant_change', 'off_by_one']

def _gold_tests(repo: Repo, names) -> dict:
    "The project's own test files as the visible `tests/` of a gold solution (hidden-package imports turned back into `tests`)."
    hp = f'c2t_{repo.package}'; out = {}
    for n in names:
        t = repo.tests[f'{hp}/{n}'] if f'{hp}/{n}' in repo.tests else repo.tests[n]
        out[f'tests/{n}'] = re.sub(rf'\bfrom (?:{hp}|\.) import', 'from tests import', t)
    return out

def _tests_task(repo, rel, gold: dict, target, muts_at, rng, template, n_mut=3) -> Task | None:
    text = repo.files[rel]
    ms = _bugs(text, rng, n_mut, _MUT_KINDS) if muts_at is None else None
    if muts_at is not None:
        cands = [m for m in find_mutations(text, _MUT_KINDS) if m.func.split('.')[0] == muts_at]; rng.shuffle(cands); ms, fs = [], set()
        for m in cands:
            if len(ms) >= n_mut: break
            if m.func not in fs and check_mutation(text, m): ms.append(m); fs.add(m.func)
        if len(ms) < 2: return None
    if not ms: return None
    mutants = [mutate(text, [m]) for m in ms]
    hidden = {**repo.tests, 'test_c2_mutants.py': program_text('check_mutants.py', MODULE=repr(repo.mod_of(rel)), REL=repr(rel), N_MUT='%d' % len(mutants)),
              f'original/{rel}': text, **{f'mutants/m{j}/{rel}': t for j, t in enumerate(mutants)}}
    if gold.get('tests/__init__.py') is None and len(gold) > 0 and any('from tests import' in v for v in gold.values()):
        gold['tests/__init__.py'] = ''
    p = rng.choice([f"{target} has no tests in this repo and we keep shipping regressions. Please add a unittest suite under tests/ that passes today and would catch wrong operators, off-by-one errors or missing branches.",
                    f"Before we refactor {target} we want a regression suite: thorough unittest tests (in tests/) that pass on the current code and fail if its behaviour changes subtly.",
                    f"Write unit tests for {target}. They must pass now and catch real mistakes; we'll judge them by seeding bugs."])
    return Task(id=f'{repo.name}-{template}', category='tests', prompt=p, solution=gold,
                **repo.base(hidden_tests=hidden, test_modules=repo.test_modules + ['test_c2_mutants'],
                            metadata={'template': template, 'n_mutants': len(mutants), 'target': target, 'kinds': [template],
                                      'mutations': [dataclasses.asdict(m) for m in ms]}))

def gen_tests_module(repo: Repo, rng, n: int = 1) -> list[Task]:
    "A test suite for one module, graded by hidden mutants of it; gold: the project's own test file(s) for it."
    out = []
    for rel, tests in _pick(rng, sorted(repo.test_files.items()), n):
        gold = _gold_tests(repo, tests if isinstance(tests, list) else [Path(tests).name])
        if (t := _tests_task(repo, rel, gold, f"the `{repo.mod_of(rel)}` module", None, rng, 'tests_module')): out.append(t)
    return out

def gen_tests_class(repo: Repo, rng, n: int = 2, classes: dict | None = None) -> list[Task]:
    "A test suite for one class (mutants only in its methods); gold: the project's test file for the class."
    out = []
    for cname, (rel, tests) in _pick(rng, sorted((classes or {}).items()), n):
        gold = _gold_tests(repo, tests)
        if (t := _tests_task(repo, rel, gold, f"`{cname}`", cname, rng, 'tests_class')): out.append(t)
    return out

def project_files(repo: Repo) -> dict:
    "The repo as a small project: packaging config, a test runner, make targets and a CI script (tests visible under `tests/`)."
    hp = f'c2t_{repo.package}'
    code = sorted(r for r in repo.files if r.endswith('.py'))
    mk = program_text('devops/Makefile', MODULE=repo.package).replace(f'py_compile {repo.package}.py', 'py_compile ' + ' '.join(code))
    tests = {'tests/__init__.py': ''}
    for p, t in repo.tests.items():
        if p.endswith('.py'): tests['tests/' + Path(p).name] = re.sub(rf'\bfrom {hp}\b', 'from tests', t)
    return {**repo.files, **tests, 'pyproject.toml': program_text('devops/pyproject.toml', MODULE=repo.package),
            'run_tests.py': program_text('devops/run_tests.py'), 'Makefile': mk, 'ci.sh': program_text('devops/ci.sh')}

DEVOPS_BREAKS_V2 = {   # name: (file, old, new, symptom)
    **DEVOPS_BREAKS,
    'runner_key': ('run_tests.py', 'cfg["start-dir"]', 'cfg["start_dir"]', 'the test runner dies with a KeyError before running anything'),
    'runner_exit': ('run_tests.py', 'sys.exit(0 if result.wasSuccessful() else 1)', 'sys.exit(1 if result.wasSuccessful() else 0)', 'CI reports failure even though every test passes'),
    'pyproject_module': ('pyproject.toml', 'module = "', 'module = "lib_', 'the test runner fails importing the code under test'),
    'ci_python': ('ci.sh', 'PYTHON="${PYTHON:-python3}"', 'PYTHON="${PYTHON:-python2}"', 'CI cannot find the interpreter on machines without python2'),
    'makefile_check': ('Makefile', 'check: lint test', 'check: lint', 'CI is green but the unit tests never run'),
}

def _n_tests(repo):
    return max(1, sum(len(re.findall(r'^\s+def test', t, re.M)) for t in repo.tests.values()) // 2)

def _devops_task(repo, template, broken, good, prompt, meta) -> Task:
    changed = {p: good.get(p) for p in set(good) | set(broken) if good.get(p) != broken.get(p)}
    hidden = {**repo.tests, 'test_c2_build.py': program_text('check_build.py', N_TESTS='%d' % _n_tests(repo))}
    return Task(id=f'{repo.name}-{template}', category='devops', prompt=prompt, solution=changed,
                **repo.base(files=broken, hidden_tests=hidden, test_modules=repo.test_modules + ['test_c2_build'],
                            metadata={'template': template, 'kinds': [template], **meta}))

def gen_devops_repair(repo: Repo, rng, n: int = 1, k=(2, 3)) -> list[Task]:
    "2-3 breakages in the packaging, runner, make targets or CI script: get CI green again."
    good = project_files(repo); out = []
    for _ in range(n):
        for _ in range(30):
            pick = rng.sample(sorted(DEVOPS_BREAKS_V2), rng.choice(list(k)))
            if len({DEVOPS_BREAKS_V2[p][0] for p in pick}) == len(pick) and all(DEVOPS_BREAKS_V2[p][1] in good[DEVOPS_BREAKS_V2[p][0]] for p in pick): break
        else: continue
        broken = dict(good)
        for p in pick:
            f, old, new, _ = DEVOPS_BREAKS_V2[p]; broken[f] = broken[f].replace(old, new, 1)
        syms = [DEVOPS_BREAKS_V2[p][3] for p in pick]
        prompt = rng.choice([f"CI for the {area(repo.name)} project is red: {'; '.join(syms)}. Nobody touched the library code. Please get `make check` and the CI script green again without skipping tests.",
                             f"Our build is broken ({'; also '.join(syms)}). Repair the build and test setup so the whole suite runs and passes."])
        out.append(_devops_task(repo, 'devops_repair', broken, good, prompt, {'breakages': pick}))
    return out

_REBUILD = [('Makefile', 'run_tests.py', 'ci.sh'), ('run_tests.py', 'Makefile'), ('Makefile', 'run_tests.py', 'ci.sh', 'tests/__init__.py')]

def gen_devops_rebuild(repo: Repo, rng, n: int = 1) -> list[Task]:
    "Part of the build setup is missing (runner, make targets, CI script): write it so `sh ci.sh` lints and runs every test."
    good = project_files(repo); out = []
    for gone in _pick(rng, _REBUILD, n):
        broken = {p: t for p, t in good.items() if p not in gone or (p == 'tests/__init__.py' and t.strip())}
        broken['pyproject.toml'] = good['pyproject.toml'].split('[tool.c2test]')[0].rstrip() + '\n'
        prompt = rng.choice(["There is no working CI entry point in this repo any more. `sh ci.sh` (honouring $PYTHON) should byte-compile the code and run the full unittest suite under tests/, failing if anything fails. Please set that up.",
                             "We lost our build scripts. Please recreate them: a `ci.sh` that runs `make check`, where check byte-compiles the sources and runs all unit tests in tests/ with $PYTHON, and exits non-zero on any failure."])
        out.append(_devops_task(repo, 'devops_rebuild', broken, good, prompt, {'removed': list(gone)}))
    return out
def changed_lines_v2(diff: str) -> int:
    "Added plus removed lines of a unified diff, a pure move (a line removed in one place and added verbatim elsewhere) counted once."
    from collections import Counter
    add, rem = Counter(), Counter()
    for l in diff.splitlines():
        if l.startswith('+') and not l.startswith('+++'): add[l[1:]] += 1
        elif l.startswith('-') and not l.startswith('---'): rem[l[1:]] += 1
    moved = sum(min(c, add[k]) for k, c in rem.items() if k.strip())
    return sum(add.values()) + sum(rem.values()) - moved

GENERATORS = {'feature_class': gen_feature_class, 'feature_funcs': gen_feature_funcs, 'feature_module': gen_feature_module,
              'move_class': gen_move_class, 'split_module': gen_split_module,
              'debug_multi': gen_debug_multi, 'debug_blocks': gen_debug_blocks, 'debug_cross_file': gen_debug_cross_file,
              'docs_module': gen_docs_module, 'docs_class': gen_docs_class, 'docs_api': gen_docs_api,
              'tests_module': gen_tests_module, 'tests_class': gen_tests_class,
              'devops_repair': gen_devops_repair, 'devops_rebuild': gen_devops_rebuild}
"The v2 task templates, each a generator `(repo, rng, n) -> candidate tasks`."

def build_v2(repos: list[Repo], plan: dict[str, int], seed: int = 0, runs: int = 3, timeout: float = 60, backend: str = 'sandbox',
             workers: int = 2, rounds: int = 3, extra: dict | None = None, log=None) -> tuple[list[Task], dict]:
    """Generate and validate tasks: `plan[template]` validated tasks of each template, spread round-robin over the repos
    that the template applies to; candidates are validated `workers` at a time. `extra[template][repo]`: extra generator kwargs."""
    import random
    bad = set(plan) - set(GENERATORS)
    if bad: raise TaskError(f"tasks_v2.plan: unknown templates {sorted(bad)}; templates: {sorted(GENERATORS)}")
    rng = random.Random(seed); out, reports, tried = [], [], {}
    seen = set()
    for tpl, need in plan.items():
        got = []
        for r in range(rounds):
            if len(got) >= need: break
            cands = []
            per = max(1, -(-(need - len(got)) * (2 if r else 1) // max(1, len(repos))))
            for repo in repos:
                kw = ((extra or {}).get(tpl) or {}).get(repo.name, {})
                for c in GENERATORS[tpl](repo, random.Random(rng.random()), per, **kw):
                    key = sha256_text(json.dumps([c.files, c.solution], sort_keys=True))
                    if key not in seen: seen.add(key); cands.append(c)
            order = []   # interleave repos so an early stop keeps the mix
            by = {}
            for c in cands: by.setdefault(c.id, []).append(c)
            while any(by.values()):
                for k in list(by):
                    if by[k]: order.append(by[k].pop(0))
            order = order[:max(0, (need - len(got)) * 2)]
            tried[tpl] = tried.get(tpl, 0) + len(order)
            with ThreadPoolExecutor(max(1, workers)) as ex:
                res = list(ex.map(lambda c: validate_task(c, backend, runs=runs, timeout=timeout), order))
            for c, (v, rep) in zip(order, res):
                reports.append({**rep, 'template': tpl})
                if v is not None and len(got) < need: got.append(v)
        for i, v in enumerate(got):
            n_same = sum(t.id.startswith(v.id) for t in out)
            v.id = f'{v.id}-{n_same}'; v.metadata['kind'] = tpl
            if v.category == 'debug': v.prompt = debug_prompt(v, rng)
            v.metadata['changed_lines'] = changed_lines_v2(v.gold_patch)
            out.append(v)
        if log: log(f"  {tpl}: {len(got)} of {need} validated ({tried.get(tpl, 0)} candidates)")
    rejected = {}
    for r in reports:
        if not r['ok']:
            key = re.sub(r'\d+', 'N', (r['reasons'] or ['?'])[0])[:80]; rejected[key] = rejected.get(key, 0) + 1
    return out, {'candidates': tried, 'accepted': len(out), 'rejected_reasons': rejected,
                 'dropped_flaky_tests': sum(len(r['flaky']) for r in reports)}
def _norm_lines(text: str, min_chars: int = 12) -> list[str]:
    "Lines with comments and all whitespace removed, dropping short ones (brackets, `else:`, `pass`): what a shingle is made of."
    out = []
    for l in text.splitlines():
        l = re.sub(r'\s+', '', l.split('#', 1)[0] if not l.lstrip().startswith(('"', "'")) else l)
        if len(l) >= min_chars: out.append(l)
    return out

def shingles(text: str, k: int = 6) -> set:
    "Hashes of every `k` consecutive normalised lines of `text` (content, not names: renamed or reindented copies still match)."
    ls = _norm_lines(text)
    return {hashlib.blake2b('\n'.join(ls[i:i + k]).encode(), digest_size=8).digest() for i in range(max(0, len(ls) - k + 1))}

def task_texts(t: Task) -> list[str]:
    "The codebase texts of a task (its files, gold files, hidden tests); the harness's own checks are left out."
    hid = [v for p, v in t.hidden_tests.items() if not Path(p).name.startswith(('test_c2_', '_c2'))]
    return [v for v in list(t.files.values()) + list(t.solution.values()) + hid if v]

def scan_content(tasks: list[Task], corpus_files, min_shared: int = 3, k: int = 6) -> dict:
    """Content-based contamination check: every document of every training corpus file (JSON lines with a `text`, or task
    records) against every task's texts; a document sharing `min_shared` or more shingles with a task is a hit (`TaskError`)."""
    index = {}
    for t in tasks:
        for txt in task_texts(t):
            for s in shingles(txt, k): index.setdefault(s, set()).add(t.id)
    n_docs, hits, scanned = 0, [], []
    for f in map(Path, corpus_files):
        if not f.exists(): continue
        scanned.append(str(f))
        with open(f) as fh:
            for i, line in enumerate(fh):
                if not line.strip(): continue
                d = json.loads(line); n_docs += 1
                texts = [d['text']] if 'text' in d else [v for key in ('files', 'solution', 'hidden_tests') for v in (d.get(key) or {}).values() if v]
                count = {}
                for txt in texts:
                    for s in shingles(txt, k):
                        for tid in index.get(s, ()): count[tid] = count.get(tid, 0) + 1
                for tid, c in count.items():
                    if c >= min_shared: hits.append(f"{f.name}:{i + 1} ({d.get('path') or d.get('id')}) shares {c} shingles with task {tid}")
    if hits: raise TaskError(f"content contamination: {len(hits)} corpus document(s) overlap benchmark tasks: " + '; '.join(hits[:10]))
    return {'ran': bool(scanned), 'files': scanned, 'docs_scanned': n_docs, 'task_shingles': len(index), 'k_lines': k,
            'min_shared': min_shared, 'hits': 0}
def set_stats_v2(tasks: list[Task]) -> dict:
    "Counts per category, codebase and template, the template share, and medians of prompt length and changed lines (moves counted once)."
    cl = [changed_lines_v2(t.gold_patch) for t in tasks]; pl = [len(t.prompt) for t in tasks]
    tpl = {}
    for t in tasks: tpl[t.metadata.get('template', '?')] = tpl.get(t.metadata.get('template', '?'), 0) + 1
    src = {}
    for t in tasks: src[t.source] = src.get(t.source, 0) + 1
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else 0
    return {'n_tasks': len(tasks), 'median_prompt_chars': statistics.median(pl) if pl else 0,
            'median_gold_changed_lines': statistics.median(cl) if cl else 0,
            'categories': {c: sum(t.category == c for t in tasks) for c in CATEGORIES}, 'codebases': src, 'templates': tpl,
            'max_template_share': round(max(tpl.values()) / len(tasks), 3) if tasks else 0,
            'prompt_chars_quartiles': [q(pl, .25), q(pl, .5), q(pl, .75)], 'changed_lines_quartiles': [q(cl, .25), q(cl, .5), q(cl, .75)],
            'prompt_chars': pl, 'changed_lines': cl}


SDIST_LAYOUT = {   # package: licence, module file -> its own test files (tests tasks), class -> (file, test files)
    'cachetools': {'licence': 'MIT', 'skip_tests': [],
                   'test_files': {'cachetools/keys.py': ['test_keys.py'], 'cachetools/func.py': ['test_func.py']},
                   'classes': {c: ('cachetools/__init__.py', ['__init__.py', f'test_{s}.py']) for c, s in
                               [('FIFOCache', 'fifo'), ('LFUCache', 'lfu'), ('LRUCache', 'lru'), ('RRCache', 'rr'), ('TTLCache', 'ttl'), ('TLRUCache', 'tlru')]}},
    'more_itertools': {'licence': 'MIT', 'skip_tests': [],
                       'test_files': {'more_itertools/recipes.py': ['test_recipes.py']}, 'classes': {}},
}

@dataclass
class SdistSource:
    name: str
    version: str
    sha256: str
    package: str

@dataclass
class TasksV2Config:
    bench_name: str = 'ReserveBench'
    version: str = 'v2'
    out_dir: str = 'data/tasks_v2'
    exclusions: str = 'data/corpus/exclusions.json'
    corpora: list[str] = field(default_factory=lambda: ['data/corpus/general.jsonl', 'data/corpus/code_train.jsonl',
                                                        'data/corpus/code_val.jsonl', 'data/corpus/heldout.jsonl', 'data/tasks/train.jsonl'])
    modules: list[str] = field(default_factory=lambda: ['textwrap', 'shlex', 'fractions', 'pprint', 'configparser', 'difflib', 'string', 'netrc'])
    sdists: list[SdistSource] = field(default_factory=list)
    plan: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    runs: int = 3
    timeout_s: float = 60
    workers: int = 2
    backend: str = 'sandbox'
    min_shared_shingles: int = 3
    def __post_init__(self):
        from .config import check
        check(self.runs >= 1, f"tasks_v2.runs: must be >= 1, got {self.runs}")
        check(self.backend in ('sandbox', 'local'), f"tasks_v2.backend: 'sandbox' or 'local', got {self.backend!r}")
        bad = set(self.plan) - set(GENERATORS)
        check(not bad, f"tasks_v2.plan: unknown templates {sorted(bad)}; templates: {sorted(GENERATORS)}")

def make_repos(cfg: TasksV2Config, sdist_dir) -> tuple[list[Repo], list[dict]]:
    "The stdlib repos and the pinned, hash-checked sdists as repos; plus a record of each source (for the datasheet)."
    from .tasks_data import fetch_sdist
    repos = [Repo.from_stdlib(m) for m in cfg.modules]
    info = [{'codebase': 'stdlib', 'modules': list(cfg.modules), 'licence': 'PSF-2.0', 'python': __import__('sys').version.split()[0]}]
    for s in cfg.sdists:
        p = fetch_sdist(s.name, s.version, s.sha256, sdist_dir)
        lay = SDIST_LAYOUT.get(s.package, {})
        r = repo_from_sdist(p, s.package, lay.get('licence', '?'), lay.get('skip_tests', ()))
        r.test_files = dict(lay.get('test_files', {}))
        repos.append(r)
        info.append({'codebase': r.codebase, 'package': s.package, 'sha256': s.sha256, 'licence': r.licence,
                     'files': len(r.files), 'test_modules': len(r.test_modules)})
    return repos, info

def class_targets(repos) -> dict:
    "`extra` kwargs of `build_v2`: the class -> test file map of each sdist for `tests_class`."
    return {'tests_class': {r.name: {'classes': SDIST_LAYOUT[r.package]['classes']} for r in repos if SDIST_LAYOUT.get(r.package, {}).get('classes')}}
