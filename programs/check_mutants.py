import json, os, shutil, subprocess, sys, tempfile, unittest
ROOT = os.getcwd(); HID = os.path.join(ROOT, '.c2_hidden')
MODULE, REL, N_MUT = __C2_MODULE__, __C2_REL__, __C2_N_MUT__
def user_files():
    out = []
    for dp, dn, fn in os.walk(ROOT):
        dn[:] = [d for d in dn if d not in ('.c2_hidden', '__pycache__', '.git')]
        out += [os.path.relpath(os.path.join(dp, f), ROOT) for f in fn if f.endswith('.py')]
    return sorted(out)
def run_with(module_path):
    tmp = tempfile.mkdtemp(prefix='c2mut-')
    try:
        files = user_files()
        for rel in files:
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)) or tmp, exist_ok=True)
            shutil.copy(os.path.join(ROOT, rel), os.path.join(tmp, rel))
        shutil.copy(module_path, os.path.join(tmp, REL))
        tests = [f for f in files if os.path.basename(f).startswith('test') and f != REL]
        spec = {'root': tmp, 'imports': {MODULE: REL}, 'files': tests, 'out': os.path.join(tmp, 'c2res.json'), 'per_test_timeout': 5}
        subprocess.run([sys.executable, '-S', '-E', '-s', '-B', os.path.join(HID, '_c2_run.py'), tmp, MODULE + '=' + REL, json.dumps(spec)],
                       cwd=tmp, timeout=300, capture_output=True)
        with open(spec['out']) as f: return json.load(f)
    finally: shutil.rmtree(tmp, ignore_errors=True)
class WrittenTests(unittest.TestCase):
    def test_written_tests_pass_on_original(self):
        r = run_with(os.path.join(HID, 'original', REL))
        self.assertTrue(r['imports'][MODULE]['ok'], 'module under test not imported from the project')
        self.assertFalse(r['load_errors'], r['load_errors'])
        self.assertGreater(len(r['results']), 0, 'no tests found')
        bad = [t for t, s in r['results'].items() if s not in ('pass', 'skip')]
        self.assertEqual(bad, [], 'tests fail on the correct code')
    def _kill(self, i):
        r = run_with(os.path.join(HID, 'mutants', 'm%d' % i, REL))
        killed = bool(r['load_errors']) or any(s in ('fail', 'error') for s in r['results'].values())
        self.assertTrue(r['results'] and killed, 'a seeded bug goes unnoticed by the tests')
for _i in range(N_MUT): setattr(WrittenTests, 'test_catches_bug_%d' % _i, lambda self, i=_i: self._kill(i))
