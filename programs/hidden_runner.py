
import os, sys
# argv: root, 'mod=rel;mod=rel', json spec. Only `os` and `sys` (which import no reserved module) come before the
# task modules, so the workspace copies are the ones everything else (collections, unittest, ...) gets.
root = os.path.abspath(sys.argv[1])
hidden = os.path.join(root, '.c2_hidden')
sys.path[:0] = [root] + ([hidden] if os.path.isdir(hidden) else [])
out = {'imports': {}, 'results': {}, 'messages': {}, 'load_errors': {}}
for item in filter(None, sys.argv[2].split(';')):
    mod, rel = item.split('=', 1)
    try:
        __import__(mod); m = sys.modules[mod]
        f = os.path.realpath(getattr(m, '__file__', '') or '')
        out['imports'][mod] = {'file': f, 'ok': f == os.path.realpath(os.path.join(root, rel))}
    except BaseException as e:
        out['imports'][mod] = {'file': None, 'ok': False, 'error': (type(e).__name__ + ': ' + str(e))[:300]}
import importlib, importlib.util, json, signal, traceback
spec = json.loads(sys.argv[3])
import unittest
class Timeout(Exception): pass
def _alarm(*a): raise Timeout('test took longer than %s s' % spec.get('per_test_timeout', 10))
signal.signal(signal.SIGALRM, _alarm)
class Result(unittest.TestResult):
    def startTest(self, t):
        super().startTest(t); signal.setitimer(signal.ITIMER_REAL, spec.get('per_test_timeout', 10))
    def stopTest(self, t):
        signal.setitimer(signal.ITIMER_REAL, 0); super().stopTest(t)
    def _set(self, t, s, err=None):
        tid = t.id()
        if out['results'].get(tid) in ('fail', 'error') and s == 'pass': return
        out['results'][tid] = s
        if err is not None:
            lines = traceback.format_exception_only(err[0], err[1])
            out['messages'][tid] = ''.join(lines).strip()[-20000:]   # the grader masks run-specific text, then keeps the tail
    def addSuccess(self, t): self._set(t, 'pass')
    def addFailure(self, t, err): self._set(t, 'fail', err)
    def addError(self, t, err): self._set(t, 'error', err)
    def addSkip(self, t, reason): self._set(t, 'skip')
    def addExpectedFailure(self, t, err): self._set(t, 'pass')
    def addUnexpectedSuccess(self, t): self._set(t, 'fail')
    def addSubTest(self, t, st, err):
        if err is not None: self._set(t, 'fail' if issubclass(err[0], t.failureException) else 'error', err)
loader = unittest.TestLoader()
suites = []
for name in spec.get('tests', []):
    try: suites.append(loader.loadTestsFromName(name))
    except BaseException as e: out['load_errors'][name] = (type(e).__name__ + ': ' + str(e))[:300]
for i, path in enumerate(spec.get('files', [])):
    try:
        s = importlib.util.spec_from_file_location('c2_user_tests_%d' % i, os.path.join(root, path))
        m = importlib.util.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m)
        suites.append(loader.loadTestsFromModule(m))
    except BaseException as e: out['load_errors'][path] = (type(e).__name__ + ': ' + str(e))[:300]
res = Result()
devnull = open(os.devnull, 'w'); so, se = sys.stdout, sys.stderr
sys.stdout = sys.stderr = devnull
try: unittest.TestSuite(suites).run(res)
finally: sys.stdout, sys.stderr = so, se
tmp = spec['out'] + '.tmp'
with open(tmp, 'w') as f: json.dump(out, f)
os.replace(tmp, spec['out'])
