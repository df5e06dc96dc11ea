"""Task validation (`composer2.tasks_grade.validate_task`, as `tasks_v2` builds its set) with a repo state's runs at
once against the same runs one after another (the plain loop it replaced), measured in the same run: `build_v2` on the
repos of `tasks_v2` as the stage makes them (14 stdlib modules and the two pinned sdists, taken from
`data/tasks_v2/sdists` or downloaded and hash-checked into a temporary folder; `--stdlib-only` leaves them out) with a
small plan, `--workers` candidates at a time, sandboxed.
Arms interleaved, `--repeat` rounds; prints wall time, the cores used (this process and its children), the ratio of
the loop's best time to ours (>1: ours is faster), and whether both built the same tasks to the byte.
On the Intel Xeon (2026-12-07) with the sdists: 1.41x (63.8 s against 89.8 s, 1.76 cores against 1.24, the same 17
tasks); stdlib only, where more candidates validate side by side anyway, 1.13x.
`python benchmarks/bench_validate.py [--repeat 2] [--workers 3] [--stdlib-only]`."""
import argparse, dataclasses, hashlib, json, resource, sys, tempfile, time
sys.path.insert(0, __file__.rsplit('/', 1)[0])
import _common  # noqa: F401  (the pipeline's allocator setting)
import composer2.tasks_grade as G
from composer2.config import load_section, repo_root
from composer2.env_base import bwrap_available
from composer2.tasks_v2 import TasksV2Config, build_v2, class_targets, make_repos

ap = argparse.ArgumentParser(); ap.add_argument('--repeat', type=int, default=2); ap.add_argument('--workers', type=int, default=3)
ap.add_argument('--backend', default='sandbox', choices=['sandbox', 'local']); ap.add_argument('--stdlib-only', action='store_true')
a = ap.parse_args()
if a.backend == 'sandbox' and not bwrap_available():
    print('bench_validate: skipped: no bubblewrap here (try --backend local)'); sys.exit(0)
cfg = load_section(TasksV2Config, 'tasks_v2', repo_root() / 'params.yaml')
if a.stdlib_only: cfg = dataclasses.replace(cfg, sdists=[])
have = repo_root() / 'data' / 'tasks_v2' / 'sdists'
tmp = None if have.exists() else tempfile.TemporaryDirectory(prefix='bench_validate_')   # removed at exit, even on an error
repos, _ = make_repos(cfg, have if tmp is None else tmp.name)
plan = {'split_module': 4, 'debug_multi': 5, 'devops_repair': 4, 'feature_funcs': 4}
ours = G._runs

def loop_runs(files, task, n, backend, limits, cache, timeout):
    "The baseline: the runs of a state one after another."
    have = cache.setdefault(G._state_key(files, task), []) if cache is not None else []
    while len(have) < n: have.append(G.run_state(files, task, backend, limits, timeout))
    return have[:n]

def cpu_s():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

def arm(runs_fn):
    G._runs = runs_fn
    try:
        c0, t0 = cpu_s(), time.perf_counter()
        out, st = build_v2(repos, plan, seed=cfg.seed, runs=cfg.runs, timeout=cfg.timeout_s, backend=a.backend, workers=a.workers,
                           extra=class_targets(repos), cap=cfg.max_per_template)
        wall = time.perf_counter() - t0; cpu = cpu_s() - c0
    finally: G._runs = ours
    sha = hashlib.sha256(json.dumps([dataclasses.asdict(t) for t in out], sort_keys=True, default=str).encode()).hexdigest()
    return wall, cpu, sha, len(out)

res = {'at once': [], 'loop': []}
for r in range(a.repeat):
    for name, fn in (('at once', ours), ('loop', loop_runs)):
        wall, cpu, sha, n = arm(fn); res[name].append((wall, sha))
        print(f'round {r + 1} {name:8s}: {n} tasks validated in {wall:.1f} s, {cpu / wall:.2f} cores, sha256 {sha[:12]}', flush=True)
shas = {s for v in res.values() for _, s in v}
best = {k: min(w for w, _ in v) for k, v in res.items()}
print(f'RATIO validation, runs one after another / at once (best of {a.repeat}) = {best["loop"] / best["at once"]:.2f}x; '
      f'same tasks in every run: {len(shas) == 1}')
