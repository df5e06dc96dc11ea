import os, re, subprocess, sys, unittest
ROOT = os.getcwd()
class BuildCheck(unittest.TestCase):
    def test_ci_script_passes(self):
        env = dict(os.environ, PYTHON=sys.executable, PYTHONDONTWRITEBYTECODE='1')
        r = subprocess.run(['sh', 'ci.sh'], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        out = r.stdout + r.stderr
        self.assertEqual(r.returncode, 0, out[-1500:])
        m = re.search(r'Ran (\d+) tests?', out)
        self.assertTrue(m, 'the tests did not run')
        self.assertGreaterEqual(int(m.group(1)), __C2_N_TESTS__, 'fewer tests ran than the project has')
        self.assertRegex(out, r'\nOK')
