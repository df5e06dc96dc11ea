"ReserveBench v2: sdist repos, the fifteen templates, moves counted once, the content contamination check, hidden package copies."
import io, json, random, tarfile
from pathlib import Path

import pytest

from composer2 import tasks as T
from composer2 import tasks_v2 as V
from composer2.tasks_grade import hidden_paths, package_copies

pytestmark = pytest.mark.skipif(T.stdlib_test_dir(required=False) is None,
                                reason='the Python stdlib test package is missing: task synthesis needs it')
SANDBOX, WHY = T.sandbox_available()
needs_sandbox = pytest.mark.skipif(not SANDBOX, reason=f'sandbox unavailable: {WHY}')

PKG = {'src/toy/__init__.py': '"""Toy."""\nfrom toy.core import double, half\n\n\ndef triple(x):\n    """Three times `x`, computed by repeated addition of x."""\n    y = 0\n    for _ in range(3):\n        y = y + x\n    return y\n',
       'src/toy/core.py': '"""Core."""\n\n\ndef double(x):\n    """Two times `x` (as a sum, for any number type)."""\n    if x == 0:\n        return 0\n    return x + x\n\n\ndef half(x):\n    """Half of `x`, floor division for ints."""\n    if isinstance(x, int):\n        return x // 2\n    return x / 2\n',
       'tests/__init__.py': 'ONE = 1\n',
       'tests/test_toy.py': 'import unittest, toy\nfrom tests import ONE\nclass T(unittest.TestCase):\n    def test_double(self): self.assertEqual(toy.double(ONE), 2)\n'
                            '    def test_half(self): self.assertEqual(toy.half(5), 2)\n    def test_triple(self): self.assertEqual(toy.triple(2), 6)\n    def test_zero(self): self.assertEqual(toy.double(0), 0)\n'}

EXTRA = ''.join(f'\n\ndef step_{i}(x):\n    """Step {i}: x moved towards {i} by one."""\n    if x > {i}:\n        return x - 1\n    return x + 1\n' for i in range(6))
PKG['src/toy/__init__.py'] += EXTRA; PKG['src/toy/core.py'] += EXTRA.replace('step_', 'core_step_')

def toy_sdist(tmp_path) -> Path:
    p = tmp_path / 'toy-1.0.tar.gz'
    with tarfile.open(p, 'w:gz') as tf:
        for name, text in PKG.items():
            b = text.encode(); ti = tarfile.TarInfo('toy-1.0/' + name); ti.size = len(b); tf.addfile(ti, io.BytesIO(b))
    return p

def test_changed_lines_count_a_pure_move_once():
    before = {'a.py': 'import re\n\ndef f(x):\n    return re.escape(x)\n\ny = 1\n'}
    after = {'a.py': 'import re\n\ny = 1\nfrom b import f\n', 'b.py': 'import re\n\ndef f(x):\n    return re.escape(x)\n'}
    d = T.unified_diff(before, after)
    assert T.changed_lines(d) == 8        # v1 counts every removed (3) and added (5) line
    assert V.changed_lines_v2(d) == 5     # the three moved lines (a blank one included) counted once

def test_sdist_repo_is_read_in_memory_with_hidden_tests(tmp_path):
    r = V.repo_from_sdist(toy_sdist(tmp_path), 'toy', 'MIT')
    assert sorted(r.files) == ['toy/__init__.py', 'toy/core.py'] and r.codebase == 'toy-1.0'
    assert r.test_modules == ['c2t_toy.test_toy'] and 'from c2t_toy import ONE' in r.tests['c2t_toy/test_toy.py']
    assert not (tmp_path / 'toy-1.0').exists()                                   # nothing unpacked
    assert r.mod_of('toy/core.py') == 'toy.core' and r.mod_of('toy/__init__.py') == 'toy'
    t = T.Task(id='x', category='debug', prompt='p', solution={}, **r.base())
    assert t.source == 'toy-1.0' and t.modules == ['toy'] and 'tests/test_toy.py' in t.source_files

def test_every_template_generates_large_short_prompted_candidates(tmp_path):
    repos = [V.Repo.from_stdlib('textwrap'), V.Repo.from_stdlib('configparser'), V.repo_from_sdist(toy_sdist(tmp_path), 'toy', 'MIT')]
    seen = {}
    for tpl, gen in V.GENERATORS.items():
        for r in repos:
            kw = {'classes': {'TextWrapper': ('textwrap.py', ['test_textwrap.py'])}} if tpl == 'tests_class' and r.name == 'textwrap' else {}
            for t in gen(r, random.Random(0), 1, **kw):
                assert t.metadata['template'] == tpl and t.category in T.CATEGORIES and tpl.split('_')[0] in (t.category, 'move', 'split')
                assert t.patched_files() != t.files and len(t.prompt) <= 400
                seen.setdefault(tpl, []).append(V.changed_lines_v2(t.gold_patch))
    assert set(seen) == set(V.GENERATORS), set(V.GENERATORS) - set(seen)
    big = ['feature_class', 'feature_funcs', 'feature_module', 'move_class', 'split_module', 'docs_module', 'docs_api', 'tests_module']
    assert all(min(seen[t]) >= 60 for t in big), {t: seen[t] for t in big}


def test_large_templates_make_several_candidates_per_file_all_of_100_lines_or_more():
    "The templates that carry the set's median: several different picks from one file, each a 100+ line gold change."
    for m in ('difflib', 'configparser', 'calendar'):
        r = V.Repo.from_stdlib(m)
        for gen in (V.gen_feature_funcs, V.gen_docs_api, V.gen_split_module, V.gen_move_class, V.gen_feature_class):
            cs = gen(r, random.Random(0), 6)
            assert all(V.changed_lines_v2(t.gold_patch) >= 100 for t in cs), (m, gen.__name__)
            assert len({json.dumps([t.files, t.solution], sort_keys=True) for t in cs}) == len(cs)
        assert len(V.gen_feature_funcs(r, random.Random(0), 6)) >= 3 and len(V.gen_docs_api(r, random.Random(0), 6)) >= 3

def test_move_keeps_the_old_module_importable_and_refuses_module_level_uses():
    r = V.Repo.from_stdlib('textwrap')
    gold = V._move(r, 'textwrap.py', ['shorten', 'indent'], 'textwrap_extra.py')
    assert 'def shorten' in gold['textwrap_extra.py'] and 'def shorten' not in gold['textwrap.py']
    assert gold['textwrap.py'].rstrip().endswith('from textwrap_extra import shorten, indent  # noqa: E402  (re-exported)')
    assert 'from textwrap import TextWrapper' in gold['textwrap_extra.py']
    assert V._move(r, 'textwrap.py', ['dedent'], 'textwrap_extra.py') is None      # used by the module's __main__ block

def _corpus(tmp_path, docs):
    p = tmp_path / 'code_train.jsonl'; p.write_text(''.join(json.dumps(d) + '\n' for d in docs)); return p

def test_content_check_catches_a_planted_task_and_passes_a_clean_corpus(tmp_path):
    t = V.gen_move_class(V.Repo.from_stdlib('textwrap'), random.Random(0), 1)[0]
    clean = _corpus(tmp_path, [{'path': 'other.py', 'text': T.stdlib_dir().joinpath('string.py').read_text()}])
    s = V.scan_content([t], [clean, tmp_path / 'absent.jsonl'])
    assert s['hits'] == 0 and s['docs_scanned'] == 1 and s['task_shingles'] > 100
    # the task's class, renamed file, reindented, comments dropped: a content match, not a name match
    src = t.solution['textwrap_textwrapper.py']
    planted = '\n'.join('    ' + l.split('#')[0].rstrip() for l in src.splitlines()[40:120])
    dirty = tmp_path / 'general.jsonl'; dirty.write_text(json.dumps({'path': 'vendor/wrap_helpers.py', 'text': planted}) + '\n')
    with pytest.raises(T.TaskError, match=r'general.jsonl:1 \(vendor/wrap_helpers.py\) shares \d+ shingles with task'):
        V.scan_content([t], [clean, dirty])
    # the stage's first pass: hits reported (the stage drops those tasks and scans again, which must then be clean)
    s = V.scan_content([t], [clean, dirty], fail=False)
    assert s['hits'] == 1 and s['hit_tasks'] == [t.id] and 'wrap_helpers' in s['hit_examples'][0]
    # only what the agent must write (and the hidden tests) counts, not untouched workspace files
    other = V.gen_feature_funcs(V.Repo.from_stdlib('configparser'), random.Random(0), 1)[0]
    assert V.scan_content([other], [dirty])['hits'] == 0
    # a training task file (records, not documents) is scanned through its files too
    rec = tmp_path / 'train.jsonl'; rec.write_text(json.dumps({'id': 'train/x', 'files': {'w.py': planted}, 'solution': {}, 'hidden_tests': {}}) + '\n')
    with pytest.raises(T.TaskError, match='train/x'): V.scan_content([t], [rec])

def test_hidden_paths_cover_every_copy_of_an_sdist_package(monkeypatch):
    monkeypatch.setattr('composer2.tasks_grade._PY_DIRS', {'more_itertools': ['/x/setuptools/_vendor/more_itertools'], '': []})
    assert hidden_paths(['more_itertools']) == ['/x/setuptools/_vendor/more_itertools']
    assert all('/x/' not in p for p in hidden_paths(['textwrap']))               # stdlib names: only the stdlib originals
    assert package_copies('no_such_package_c2') == []

@pytest.mark.slow
@needs_sandbox
def test_sandbox_hides_vendored_copies_of_an_sdist_package():
    copies = [p for p in package_copies('more_itertools') if Path(p, 'more.py').exists()]
    if not copies: pytest.skip('no readable copy of more_itertools on this machine')
    t = T.Task(id='leak', category='debug', prompt='p', solution={}, modules=['more_itertools'], files={'more_itertools/__init__.py': ''},
               hidden_tests={}, test_modules=[], import_checks={})
    with T.task_env(t) as env:
        r = env.run('ls ' + ' '.join(f"'{p}'" for p in copies) + ' | grep -c "more.py" || true')
        assert r.stdout.strip() == '0', r.text()
    with T.TaskEnv(t.files, hide=[]) as env:
        assert env.run(f"ls '{copies[0]}'").stdout.count('more.py') == 1

@pytest.mark.slow
@needs_sandbox
def test_a_move_task_and_a_tests_task_validate_in_the_sandbox():
    r = V.Repo.from_stdlib('textwrap')
    for t in [V.gen_move_class(r, random.Random(0), 1)[0], V.gen_tests_module(r, random.Random(0), 1)[0]]:
        v, rep = T.validate_task(t, runs=1, timeout=120)
        assert v is not None, rep['reasons']
        assert any('test_c2_' in x for x in v.fail_to_pass) and len(v.pass_to_pass) > 10

def test_config_rejects_unknown_templates():
    with pytest.raises(Exception, match='unknown templates'): V.TasksV2Config(plan={'rewrite_it_all': 1})
    cfg = V.TasksV2Config(sdists=[V.SdistSource('cachetools', '5.5.0', 'ab' * 32, 'cachetools')])
    assert cfg.out_dir == 'data/tasks_v2' and cfg.sdists[0].package == 'cachetools'

def _reference_build(repos, plan, seed, fake, rounds=3):
    "The plain serial algorithm build_v2 must match: generate every repo, interleave, keep 2x the shortfall, validate in order."
    import hashlib
    rng = random.Random(seed); got, seen, order = {t: [] for t in plan}, set(), []
    for tpl, need in plan.items():
        for r in range(rounds):
            if len(got[tpl]) >= need: break
            by = {}
            per = max(1, -(-(need - len(got[tpl])) * (2 if r else 1) // len(repos)))
            for repo in repos:
                for c in V.GENERATORS[tpl](repo, random.Random(rng.random()), per):
                    key = hashlib.sha256(json.dumps([c.files, c.solution, c.hidden_tests], sort_keys=True).encode()).hexdigest()
                    if key not in seen: seen.add(key); by.setdefault(c.id, []).append(c)
            cands = []
            while any(by.values()):
                for k in list(by):
                    if by[k]: cands.append(by[k].pop(0))
            for c in cands[:(need - len(got[tpl])) * 2]:
                v, _ = fake(c); order.append(c.id)
                if v is not None and len(got[tpl]) < need: got[tpl].append(v)
    return [(v.id, v.files) for tpl in plan for v in got[tpl]], order

def test_build_v2_validates_exactly_the_candidates_of_the_serial_algorithm(monkeypatch):
    import hashlib, threading, time
    calls, caches = [], set()
    def fake(task, backend='sandbox', runs=3, cache=None, timeout=12, **kw):
        h = int(hashlib.sha256(json.dumps([task.files, task.solution], sort_keys=True).encode()).hexdigest(), 16)
        if cache is not None: calls.append(task.id); caches.add(id(cache)); time.sleep((h % 5) / 1000)   # out-of-order finishes
        ok = h % 3 != 0
        return (V.dataclasses.replace(task, fail_to_pass=['t.T.test_x']) if ok else None), {'id': task.id, 'ok': ok, 'reasons': [] if ok else ['no'], 'flaky': []}
    monkeypatch.setattr(V, 'validate_task', fake)
    repos = [V.Repo.from_stdlib(m) for m in ['textwrap', 'shlex', 'fractions']]
    plan = {'debug_multi': 4, 'feature_funcs': 1}   # 1: a shortfall of 2 candidates from 3 repos
    want, order = _reference_build(repos, plan, 0, fake)
    out, info = V.build_v2(repos, plan, seed=0, workers=3, top_up=[])
    assert [(t.id.rsplit('-', 1)[0], t.files) for t in out] == want        # same tasks, same order
    assert sorted(calls) == sorted(order) and sum(info['candidates'].values()) == len(order)   # each candidate validated once, no extra
    assert len(caches) == 1                                                  # one shared cache of test runs
