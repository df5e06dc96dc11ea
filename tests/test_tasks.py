"Task synthesis: sources and exclusions, mutations, generators, prompts, validation (F2P/P2P, flaky tests), contamination."
import dataclasses, hashlib, json, random, re
from pathlib import Path

import pytest

from composer2 import tasks as T
from composer2.tasks_grade import MESSAGE_CHARS
from composer2.io import PinnedFileError

pytestmark = pytest.mark.skipif(T.stdlib_test_dir(required=False) is None,
                                reason='the Python stdlib test package is missing: task synthesis needs it')
SANDBOX, WHY = T.sandbox_available()
needs_sandbox = pytest.mark.skipif(not SANDBOX, reason=f'sandbox unavailable: {WHY}')

from conftest import TOY_ORIG as ORIG, TOY_TESTS as TESTS, toy_task

def toy(**kw):
    "The shared toy task with a two-line bug (`>=` and `return 2`)."
    return toy_task(**{'files': {'toymod.py': ORIG.replace('x > 0', 'x >= 0').replace('return 1', 'return 2')},
                       'prompt': 'Sign of positive numbers is wrong.', **kw})

def test_exclusions_structure_and_load(tmp_path):
    exc = T.default_exclusions(['fnmatch'])
    assert exc['stdlib_dir'] == str(T.stdlib_dir()) and exc['reserved_modules'] == ['fnmatch']
    f = {x['path']: x['sha256'] for x in exc['files']}
    assert f['fnmatch.py'] == hashlib.sha256((T.stdlib_dir() / 'fnmatch.py').read_bytes()).hexdigest()
    p = tmp_path / 'exclusions.json'; p.write_text(json.dumps(exc))
    assert T.load_exclusions(p) == exc
    p.write_text(json.dumps({'stdlib_dir': 'x', 'reserved_modules': []}))
    with pytest.raises(T.TaskError, match="'files'"): T.load_exclusions(p)

def test_sdist_hash_check(tmp_path):
    p = tmp_path / 'demo-1.0.tar.gz'; p.write_bytes(b'demo sdist bytes')
    good = hashlib.sha256(b'demo sdist bytes').hexdigest()
    assert T.verify_sha256(p, good) == good
    with pytest.raises(PinnedFileError, match='sha256 mismatch'): T.verify_sha256(p, hashlib.sha256(b'other').hexdigest())

def test_contamination_check_fails_loudly():
    src = T.Source.load('fnmatch')
    t = T.Task(id='ok', category='refactor', prompt='p', solution={}, **src.base())
    exc = T.default_exclusions(['fnmatch'])
    assert T.check_contamination([t], exc)['files_on_list'] == 2
    leak = dataclasses.replace(t, id='leak', source_files=t.source_files + ['os.py'])
    with pytest.raises(T.TaskError, match=r'leak: os.py is not on the exclusion list'): T.check_contamination([t, leak], exc)
    with pytest.raises(T.TaskError, match="module 'fnmatch' is not reserved"): T.check_contamination([t], T.default_exclusions(['getopt']))
    changed = dataclasses.replace(t, id='changed', source_sha256={**t.source_sha256, 'fnmatch.py': '0' * 64})
    with pytest.raises(T.TaskError, match='differs from the excluded file'): T.check_contamination([changed], exc)

def test_task_roundtrip_and_gold_patch(tmp_path):
    t = toy()
    assert T.changed_lines(t.gold_patch) == 4 and t.patched_files() == {'toymod.py': ORIG}
    sha = T.save_tasks([t, t], tmp_path / 's.jsonl')
    assert T.load_tasks(tmp_path / 's.jsonl') == [t, t] and sha == T.sha256_file(tmp_path / 's.jsonl')
    with pytest.raises(T.TaskError, match='unknown category'): toy(category='bogus')

SNIPPET = '''def f(xs, n, flag=True):
    """Sum the positive items of the first n."""
    total = 0
    for x in xs[:n]:
        if x > 0 and flag:
            total += x - 1
    while n > 3:
        n -= 1
    return total
'''

def test_mutations_cover_every_kind_and_parse():
    ms = [m for m in T.find_mutations(SNIPPET) if T.check_mutation(SNIPPET, m)]
    assert {m.kind for m in ms} == set(T.MUTATION_KINDS)
    import ast
    for m in ms:
        out = T.mutate(SNIPPET, [m]); assert out != SNIPPET; ast.parse(out)
        assert '"""Sum the positive items of the first n."""' in out   # docstrings are never mutated
    a = next(m for m in ms if m.kind == 'op_change' and m.lineno == 6)
    b = next(m for m in ms if m.kind == 'remove_loop' and m.lineno == 7)
    both = T.mutate(SNIPPET, [a, b])
    assert 'while' not in both and 'total += x + 1' in both

def test_generators_every_category_and_prompts_have_no_file_names():
    rng = random.Random(1)
    for mod in ['fnmatch', 'textwrap']:
        src = T.Source.load(mod)
        singles = T.gen_debug(src, rng, 3)
        for t in singles: t.metadata['f2p_messages'] = {'test_x.C.test_wrap_words': f'File "/usr/lib/python3.11/{mod}.py", line 3\nAssertionError: [\'a\'] != [\'b\']'}
        made = {'debug': singles, 'feature': T.gen_feature(src, rng, 2), 'refactor': T.gen_refactor(src, rng, 2),
                'docs': T.gen_docs(src, rng, 1), 'tests': T.gen_tests(src, [t.files[src.rel] for t in singles], rng),
                'devops': T.gen_devops(src, rng, 2)}
        for cat, ts in made.items():
            assert ts, (mod, cat)
            for t in ts:
                assert t.category == cat
                if cat == 'debug': t.prompt = T.debug_prompt(t, rng)
                names = {Path(f).name for f in list(t.files) + list(t.solution)} | {'Makefile', '.py'}
                assert not [n for n in names if n in t.prompt], (t.id, t.prompt)
                assert 60 < len(t.prompt) < 700 and T.changed_lines(t.gold_patch) > 0

@needs_sandbox
def test_validation_fills_f2p_p2p_and_rejects_bad_declared_f2p():
    v, rep = T.validate_task(toy(), runs=2)
    assert rep['ok'] and v.fail_to_pass == ['test_toy.T.test_sign'] and v.pass_to_pass == ['test_toy.T.test_double']
    bad = toy(fail_to_pass=['test_toy.T.test_double'])    # passes before the patch: not a real F2P
    v, rep = T.validate_task(bad, runs=2)
    assert v is None and any('passes before the gold patch' in r for r in rep['reasons'])
    same = toy(files={'toymod.py': ORIG})                 # no change: nothing fails before
    assert T.validate_task(same, runs=1)[0] is None

def claim_code(path) -> str:
    """Test-module source defining `claim()`: the number of the run calling it, 0, 1, 2, ... in the order the runs reach
    it. `validate_task` runs a state's runs at once, so a read-then-write counter file could hand two runs one number:
    each run claims the lowest free `path.N` by an atomic `mkdir`."""
    return (f'import os\ndef claim(p={str(path)!r}):\n    i = 0\n    while True:\n'
            '        try: os.mkdir(f"{p}.{i}"); return i\n        except FileExistsError: i += 1\n')

def test_validation_drops_a_flaky_test(tmp_path):
    # Outcomes need state across runs, which a sandbox deliberately forbids: this logic test uses the local backend
    # with run numbers claimed outside the workspace. The test passes on odd runs only.
    flaky = (claim_code(tmp_path / 'count') + 'import unittest, toymod\n'
             'class F(unittest.TestCase):\n    def test_flaky(self):\n        self.assertEqual(claim() % 2, 1)\n')
    t = toy(hidden_tests={'test_toy.py': TESTS, 'test_flaky.py': flaky}, test_modules=['test_toy', 'test_flaky'])
    v, rep = T.validate_task(t, backend='local', runs=3)
    assert rep['ok'] and rep['flaky'] == ['test_flaky.F.test_flaky']
    assert 'test_flaky.F.test_flaky' not in v.fail_to_pass + v.pass_to_pass and v.fail_to_pass == ['test_toy.T.test_sign']

def test_a_states_runs_run_at_once(tmp_path):
    # The gold state's three runs overlap: each claims a number, then waits (10 s at most) until all three have. One
    # run after another, the first would wait out the 10 s and fail, and the test would not be a stable PASS_TO_PASS.
    sync = (claim_code(tmp_path / 'gold') + 'import os, time, unittest, toymod\n'
            'class S(unittest.TestCase):\n    def test_sync(self):\n        if toymod.sign(1) != 1: return\n'
            f'        claim(); t = time.time()\n        while not os.path.isdir({str(tmp_path / "gold.2")!r}) and time.time() - t < 10: time.sleep(0.02)\n'
            f'        self.assertTrue(os.path.isdir({str(tmp_path / "gold.2")!r}))\n')
    t = toy(hidden_tests={'test_toy.py': TESTS, 'test_sync.py': sync}, test_modules=['test_toy', 'test_sync'])
    v, rep = T.validate_task(t, backend='local', runs=3, timeout=30)
    assert rep['ok'] and 'test_sync.S.test_sync' in v.pass_to_pass, rep

def hangs_on_second_run(counter, gold: bool):
    """A toy task whose extra test hangs (30 s) from its second run on, in the gold state (`gold`) or the broken one.
    Outcomes need state across runs, which a sandbox forbids: run numbers claimed outside the workspace, local backend."""
    slow = (claim_code(counter) + 'import time, unittest, toymod\n'
            'class S(unittest.TestCase):\n    def test_slow(self):\n'
            f'        if toymod.sign(1) {"==" if gold else "!="} 1:\n'
            '            if claim() >= 1: time.sleep(30)\n')
    return toy(hidden_tests={'test_toy.py': TESTS, 'test_slow.py': slow}, test_modules=['test_toy', 'test_slow'])

def test_a_later_broken_state_run_that_times_out_is_named_not_read_as_flaky(tmp_path):
    # The broken state's first run finishes, its second hangs past the timeout. Its tests must not all read as
    # flipping: the candidate is rejected with the cause.
    t = hangs_on_second_run(tmp_path / 'count', gold=False)
    v, rep = T.validate_task(t, backend='local', runs=3, timeout=4, cache={})    # as tasks_v2 runs it: the quick run is reused
    assert v is None and rep['flaky'] == [], rep
    assert any(r.startswith('the broken state does not finish cleanly in run 2 of 3 (timed out: True') for r in rep['reasons']), rep

def test_a_gold_state_run_that_times_out_is_named(tmp_path):
    # The gold state's second run hangs past the timeout: rejected as a gold state that does not run cleanly, timeout named.
    v, rep = T.validate_task(hangs_on_second_run(tmp_path / 'count', gold=True), backend='local', runs=2, timeout=4, cache={})
    assert v is None and any(r.startswith('gold state does not run cleanly: timed out') for r in rep['reasons']), rep

def test_failure_messages_are_stored_without_memory_addresses():
    # A failing assertion that prints object reprs carries addresses that differ per process; the validated task
    # keeps the message (debug prompts quote it), so two validations must store the same bytes. Two shapes: unittest
    # shortens a long dict repr (leaving an address's tail), and a long message is cut to its tail, possibly inside
    # an address.
    obj = ('import unittest, toymod\nclass O(unittest.TestCase):\n'
           '    def test_obj(self): self.assertEqual({} if toymod.sign(1) == 1 else {f"o{i}": object() for i in range(40)}, {})\n'
           '    def test_long(self):\n        if toymod.sign(1) != 1: self.fail(repr([object() for _ in range(40)]))\n')
    t = toy(hidden_tests={'test_toy.py': TESTS, 'test_obj.py': obj}, test_modules=['test_toy', 'test_obj'])
    got = [T.validate_task(t, backend='local', runs=1)[0].metadata['f2p_messages'] for _ in range(2)]
    short, long = got[0]['test_obj.O.test_obj'], got[0]['test_obj.O.test_long']
    assert got[0] == got[1] and 'object at 0x?>' in short and len(long) == MESSAGE_CHARS
    assert not re.search(r'[0-9a-fA-F]>', short + long), (short, long)     # no address or tail of one is left

@needs_sandbox
def test_graded_run_imports_workspace_copy_of_startup_modules():
    # reprlib is imported by `collections` and textwrap by `traceback`: the runner must still load the workspace copies
    for mod in ['reprlib', 'textwrap']:
        src = T.Source.load(mod)
        t = T.Task(id=mod, category='refactor', prompt='p', solution={}, **src.base())
        r = T.run_state(t.files, t)
        assert r.imports[mod]['ok'] and r.imports[mod]['file'].endswith(f'/{mod}.py') and not r.imports[mod]['file'].startswith(str(T.stdlib_dir()))
        assert sum(s == 'pass' for s in r.results.values()) > 10

SCAN = r'''
import hashlib, os, re, sys
sizes = {int(s): h for s, h in (x.split(':') for x in sys.argv[1].split(','))}
names = set(sys.argv[2].split(','))
hits = []
for top in ['/usr', '/etc', '/opt', '/root', '/work', '/home', '/srv', '/var', '/tmp']:
    for dp, dns, fns in os.walk(top):
        for n in fns:
            p = os.path.join(dp, n)
            try:
                if os.path.islink(p) or not os.path.isfile(p): continue
                size = os.path.getsize(p)
                if size in sizes and hashlib.sha256(open(p, 'rb').read()).hexdigest() == sizes[size]: hits.append('copy ' + p)
                stem = n.split('.')[0]
                in_stdlib = re.search(r'/python[0-9.]+/(test/)?(__pycache__/)?[^/]+$', p)
                if stem in names and in_stdlib and size > 0 and not open(p, 'rb').read(18).startswith(b'raise ImportError'): hits.append('named ' + p)
            except OSError: pass
print('HITS', hits)
'''

@pytest.mark.slow
@needs_sandbox
def test_task_sandbox_hides_the_original_source_and_its_stdlib_tests():
    # A textwrap debug task: the original textwrap.py (the gold answer) and test_textwrap.py (the hidden test) must not
    # be readable anywhere in the sandbox, by name or by content; the workspace copy is what `import` finds.
    src = T.Source.load('textwrap')
    broken = src.text.replace('def wrap(text', 'def wrap_renamed(text')
    t = T.Task(id='leak', category='debug', prompt='p', solution={src.rel: src.text}, **src.base(files={src.rel: broken}))
    texts = [(T.stdlib_dir() / src.rel).read_bytes(), (T.stdlib_dir() / src.test_rel).read_bytes()]
    sizes = ','.join(f'{len(b)}:{hashlib.sha256(b).hexdigest()}' for b in texts)
    with T.task_env(t) as env:
        assert env.hidden and any(h.endswith('/test/test_textwrap.py') for h in env.hidden)
        r = env.run(f"python - '{sizes}' textwrap,test_textwrap <<'EOF'\n{SCAN}\nEOF", timeout=600)
        assert r.ok and 'HITS []' in r.stdout, r.text()[-2000:]
        r = env.run("cd /tmp && python -c 'import textwrap; print(hasattr(textwrap, \"wrap_renamed\"))'")
        assert r.stdout.strip() == 'True', r.text()
    # without hiding, the originals are there to find (so the scan above could fail)
    with T.TaskEnv(t.files, hide=[]) as env:
        r = env.run(f"sha256sum {T.stdlib_dir() / src.rel} {T.stdlib_dir() / src.test_rel}")
        assert [l.split()[0] for l in r.stdout.splitlines()] == [hashlib.sha256(b).hexdigest() for b in texts], r.text()


def test_local_workspace_writes_text_and_bytes(tmp_path):
    (tmp_path / 'repo').mkdir(); (tmp_path / 'repo' / 'a.py').write_text('x = 1\n')
    with T.LocalWorkspace(tmp_path / 'repo') as ws:
        ws.write_file('sub/b.bin', b'\x00\xffdata')
        ws.write_file('a.py', 'x = 2\n')
        assert ws.path('sub/b.bin').read_bytes() == b'\x00\xffdata' and ws.read_file('a.py') == 'x = 2\n'
        with pytest.raises(TypeError, match='str or bytes'): ws.write_file('c.py', 3)
        with pytest.raises(T.TaskError, match='leaves the workspace'): ws.write_file('../escape.py', 'x')
    assert (tmp_path / 'repo' / 'a.py').read_text() == 'x = 1\n'          # the source repository is untouched
