import multiprocessing, os, subprocess, sys
from pathlib import Path
import pytest, torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Inductor's FX-graph cache keys do not include ATen's CPU capability: a graph compiled for AVX2/AVX512 and cached in the
# shared /tmp/torchinductor_<user> is reloaded under ATEN_CPU_CAPABILITY=default, where its vector C++ no longer builds
# ("'at::vec' has not been declared"). Each capability gets its own cache unless the caller chose one.
if os.environ.get('ATEN_CPU_CAPABILITY') and 'TORCHINDUCTOR_CACHE_DIR' not in os.environ:
    import getpass, tempfile
    os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}")

def pytest_collection_modifyitems(config, items):
    """Files holding a `first`-marked test run before the others; the rest by their number of tests, most first (stable
    sorts: the order within a file stays). `make test` hands pytest-xdist a whole file per worker (`--dist loadfile`)
    with `--no-loadscope-reorder`, so this order is the one the workers take files in: the order pytest-xdist would
    choose itself (most tests first), except that a file of minutes queued late no longer leaves the other worker idle at
    the end. Without the `first` file first, the smoke pipeline (4.5-6 min, two tests in its file) started after some
    485 s of its worker's files and the other worker finished 200 s earlier (Intel Xeon, 2026-12-07); on an AMD EPYC
    (AVX2) the main pass's last 6 of its 14.7 minutes ran its last four tests, the smoke pipeline among them."""
    from collections import Counter
    first, count = {it.path for it in items if it.get_closest_marker('first')}, Counter(it.path for it in items)
    items[:] = sorted(items, key=lambda it: (it.path not in first, -count[it.path]))

@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield

# ---- local ranks: forked from a server that has imported torch and composer2, not spawned ----
# `composer2.parallel.spawn_local` and `composer2.pretrain_cp.run_pretrain_cp` start their ranks with
# `torch.multiprocessing.spawn`: each rank a fresh interpreter that imports torch and composer2 (~2.5 s of CPU each; a
# 4-rank start took 5.9 s on 2 idle cores). Every multi-process test starts ranks, so here `spawn` forks them from
# multiprocessing's forkserver, which imported those modules once (a 4-rank start: 0.12 s). Each rank first takes the
# parent's working directory and environment as they are at the call, which is what a spawned rank sees; everything
# else (pickled function and arguments, gloo, the error a failing rank raises) is the same code path. Tests marked
# `real_spawn` keep the plain `spawn`, so the package's own start method stays tested too.
_PRELOAD = ['torch', 'composer2.parallel', 'composer2.mesh', 'composer2.train', 'composer2.pretrain_cp', 'composer2.rl']
multiprocessing.set_forkserver_preload(_PRELOAD)    # read once, when this process first starts its forkserver

def _as_spawned(rank, fn, cwd, env, args):
    os.chdir(cwd); os.environ.clear(); os.environ.update(env)
    return fn(rank, *args)

def _forkserver_spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method='spawn'):
    "`torch.multiprocessing.spawn`'s signature; the start method is always the forkserver."
    return mp.start_processes(_as_spawned, args=(fn, os.getcwd(), dict(os.environ), tuple(args)), nprocs=nprocs, join=join,
                              daemon=daemon, start_method='forkserver')

@pytest.fixture(autouse=True)
def _fast_local_ranks(request, monkeypatch):
    if request.node.get_closest_marker('real_spawn') is None:
        monkeypatch.setattr(mp, 'spawn', _forkserver_spawn)
    yield

@pytest.fixture
def ray_serial():
    """Ray tests one at a time across pytest-xdist workers: each starts its own local instance (`address='local'`), and two
    instances starting at once on two cores can time each other's startup out."""
    from filelock import FileLock
    import tempfile
    with FileLock(os.path.join(tempfile.gettempdir(), 'composer2-tests-ray.lock')): yield

def start_server(args, timeout=180):
    """`composer2 serve *args --port 0` as a process, once it answers `/v1/models` -> (process, base url, output lines so far). The server binds its port
    before it prints it, so the port read back cannot be taken by another test in between (a port probed here and handed
    over could be). Output is drained by a thread, so a chatty server never blocks on a full pipe."""
    import queue, re, subprocess, threading, time, httpx
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': ''}
    p = subprocess.Popen([sys.executable, '-m', 'composer2.cli', 'serve', *map(str, args), '--port', '0'],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, q = [], queue.Queue()
    def drain():
        for line in p.stdout: lines.append(line); q.put(line)
        q.put(None)
    threading.Thread(target=drain, daemon=True).start()
    while True:
        try: line = q.get(timeout=timeout)
        except queue.Empty: p.kill(); pytest.fail(f'serve printed no address in {timeout}s: ' + ''.join(lines))
        if line is None: p.wait(10); pytest.fail(f'serve exited ({p.returncode}): ' + ''.join(lines))
        m = re.search(r' on (http://[^/ ]+:\d+/v1) ', line)
        if m: break
    url, t_end = m.group(1), time.monotonic() + timeout
    while True:            # ready: /v1/models answers (the one wait every server test needs)
        if p.poll() is not None: pytest.fail(f'serve exited ({p.returncode}): ' + ''.join(lines))
        try:
            if httpx.get(url + '/models', timeout=10).status_code == 200: return p, url, lines
        except httpx.TransportError: pass
        if time.monotonic() > t_end: p.kill(); pytest.fail(f'serve did not answer /v1/models in {timeout}s: ' + ''.join(lines))
        time.sleep(0.1)

def stop_server(p):
    p.terminate()
    try: p.wait(10)
    except subprocess.TimeoutExpired: p.kill(); p.wait(10)

def tiny_cfg(**kw):
    from composer2.model import ModelConfig
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=16, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)

def mtp_cfg(vocab=64, **kw):
    "The tiny MoE model of the MTP and speculative-decoding tests (2 layers, 4 experts, 256-token context)."
    from composer2.model import ModelConfig
    base = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, top_k=2, d_expert=32, max_seq_len=256)
    base.update(kw)
    return ModelConfig(**base)

def cycle_stream(n=20000, period=7, vocab=64, noise=0.0, seed=0):
    "A uint16 token stream repeating a random cycle of `period` tokens, with a fraction `noise` of random replacements."
    import numpy as np
    rng = np.random.default_rng(seed)
    s = rng.integers(0, vocab, period)[np.arange(n) % period]
    flip = rng.random(n) < noise
    s[flip] = rng.integers(0, vocab, int(flip.sum()))
    return s.astype(np.uint16)
# ---- harness (tasks/agents/bench): a toy module with a bug, its hidden test and the gold fix
TOY_ORIG = 'def sign(x):\n    if x > 0:\n        return 1\n    return -1 if x < 0 else 0\n\ndef double(x):\n    return 2 * x\n'
TOY_TESTS = ('import unittest, toymod\nclass T(unittest.TestCase):\n'
             '    def test_sign(self): self.assertEqual(toymod.sign(5), 1)\n'
             '    def test_double(self): self.assertEqual(toymod.double(2), 4)\n')

def toy_task(**kw):
    "A one-bug debug task on `toymod` (unvalidated); keyword arguments override the record's fields."
    from composer2.tasks import Task
    d = dict(id='toy', category='debug', modules=['toymod'], files={'toymod.py': TOY_ORIG.replace('if x > 0:', 'if not (x > 0):')},
             prompt='The sign of positive numbers comes out wrong.', solution={'toymod.py': TOY_ORIG},
             hidden_tests={'test_toy.py': TOY_TESTS}, test_modules=['test_toy'], import_checks={'toymod': 'toymod.py'})
    d.update(kw); return Task(**d)

@pytest.fixture(scope='session')
def validated_toy():
    "The toy task validated in the sandbox (F2P/P2P filled), or skip where no sandbox runs."
    from composer2.tasks import sandbox_available, validate_task
    ok, why = sandbox_available()
    if not ok: pytest.skip(f'sandbox unavailable: {why}')
    v, rep = validate_task(toy_task(), runs=2)
    assert rep['ok'], rep
    return v
