"""The Python half of benchmarks/gpu_check.sh (which runs each part under a time limit; see its header).

Subcommands, each writing one JSON file:
  env          python/torch/cupy/CUDA facts; exit 2 when torch sees no CUDA device, 3 when torch cannot be imported
  tests-files  the test files holding CUDA tests (printed, one a line)
  tests        summarise a pytest run (junit XML) or a collection (--collect-only log) of those files
  base         build a corpus from this repository and the standard library, then run the gpu profile's data,
               tokenizer and base stages in a scratch workspace, base capped by steps and by wall time
  merge        one summary JSON from every part's JSON; exit 0 all passed, 1 a part failed, 2 no CUDA device."""
from __future__ import annotations
import argparse, json, math, os, platform, re, shutil, signal, subprocess, sys, time, traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CUDA_TEST = re.compile(r"\.cuda\(|cuda_available\(|torch\.cuda\.is_available\(|device=['\"]cuda|mark\.gpu\b")
GPU_SKIP = re.compile(r"CUDA|cupy|sm_\d", re.I)        # a skip reason that means "no usable GPU": a failure on a GPU box


def dump(path, obj):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(obj, indent=1, default=str))


def tail(path, n=3000) -> str:
    try: return Path(path).read_text(errors='replace')[-n:]
    except OSError: return ''


def _run(cmd, **kw) -> str:
    try: return subprocess.run(cmd, capture_output=True, text=True, timeout=30, **kw).stdout.strip()
    except Exception as e: return f'unavailable ({type(e).__name__})'


# ---------------------------------------------------------------- env
def env(a) -> int:
    info = {'python': sys.executable, 'python_version': platform.python_version(), 'platform': platform.platform(),
            'cpus': os.cpu_count(), 'repo': str(REPO)}
    try:
        sys.path.insert(0, str(REPO))
        from composer2.config import git_commit
        info['git_commit'] = git_commit(REPO)             # '<sha>[-dirty]', or 'unknown' outside git
    except Exception as e: info['git_commit'] = f'unknown ({type(e).__name__})'
    try: import torch
    except Exception as e:
        info['error'] = f"cannot import torch with {sys.executable}: {e}"
        dump(a.out, info); print(info['error'], file=sys.stderr); return 3
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    try:
        import cupy
        info['cupy'] = cupy.__version__
    except Exception as e: info['cupy'] = None; info['cupy_error'] = f"{type(e).__name__}: {e}"
    info['nvcc'] = shutil.which('nvcc'); info['gxx'] = shutil.which('g++')
    if info['cuda_available']:
        info['gpu_count'] = torch.cuda.device_count()
        info['gpu_name'] = torch.cuda.get_device_name(0)
        info['capability'] = 'sm_%d%d' % torch.cuda.get_device_capability(0)
        info['gpu_memory_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
        info['bf16_supported'] = torch.cuda.is_bf16_supported()
        if info['cupy']:
            try: info['cupy_cuda_runtime'] = cupy.cuda.runtime.runtimeGetVersion()
            except Exception as e: info['cupy_error'] = f"{type(e).__name__}: {e}"
        if shutil.which('nvidia-smi'):
            info['driver'] = _run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader']).splitlines()[:1]
    else:
        why = []
        if torch.version.cuda is None: why.append(f"this torch ({torch.__version__}) is a CPU-only build")
        if os.environ.get('CUDA_VISIBLE_DEVICES') is not None and not os.environ['CUDA_VISIBLE_DEVICES'].strip():
            why.append("CUDA_VISIBLE_DEVICES is empty")
        if not shutil.which('nvidia-smi'): why.append("nvidia-smi is not on PATH (no NVIDIA driver?)")
        info['no_cuda_reason'] = "torch.cuda.is_available() is False" + (': ' + '; '.join(why) if why else '')
    dump(a.out, info)
    return 0 if info['cuda_available'] else 2


# ---------------------------------------------------------------- tests
def cuda_test_files() -> list[str]:
    "tests/test_*.py files with a CUDA test (a `.cuda(` call, a CUDA skip condition, a CUDA device or the `gpu` marker), this check's own test excepted."
    return [str(p.relative_to(REPO)) for p in sorted((REPO / 'tests').glob('test_*.py'))
            if p.name != 'test_gpu_check.py' and CUDA_TEST.search(p.read_text())]


def tests_files(a) -> int:
    files = cuda_test_files()
    print('\n'.join(files))
    return 0 if files else 1


def tests(a) -> int:
    import xml.etree.ElementTree as ET
    res = {'files': cuda_test_files(), 'mode': a.mode, 'passed': False}
    if a.mode == 'dry':                                   # collection only: every file imports, the GPU tests exist
        log = tail(a.log, 10 ** 6)
        ids = [l for l in log.splitlines() if '::' in l]
        res['collected'] = len(ids)
        res['gpu_tests_collected'] = sum('gpu' in l.split('::')[-1] for l in ids)
        res['passed'] = a.rc == 0 and res['collected'] > 0 and res['gpu_tests_collected'] > 0
        if not res['passed']: res['error'] = f"collection failed or found no GPU tests (pytest rc {a.rc})"; res['log_tail'] = tail(a.log)
        dump(a.out, res); return 0 if res['passed'] else 1
    counts = {'passed': 0, 'failed': 0, 'error': 0, 'skipped': 0}
    failures, skipped, gpu_skipped, gpu_passed = [], [], [], 0
    try: cases = list(ET.parse(a.junit).getroot().iter('testcase'))
    except (OSError, ET.ParseError) as e:
        res['error'] = f"no junit report ({e}); pytest rc {a.rc}"; res['log_tail'] = tail(a.log)
        dump(a.out, res); return 1
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name')}"
        kids = {k.tag: k for k in c}
        if 'failure' in kids or 'error' in kids:
            tag = 'failure' if 'failure' in kids else 'error'
            counts['failed' if tag == 'failure' else 'error'] += 1
            failures.append({'test': name, 'message': (kids[tag].get('message') or '')[:500]})
        elif 'skipped' in kids:
            counts['skipped'] += 1
            msg = kids['skipped'].get('message') or ''
            skipped.append({'test': name, 'reason': msg[:300]})
            if GPU_SKIP.search(msg): gpu_skipped.append(name)
        else:
            counts['passed'] += 1
            gpu_passed += 'gpu' in (c.get('name') or '')
    res.update(counts=counts, failures=failures, skipped=skipped, gpu_tests_skipped=gpu_skipped, pytest_rc=a.rc,
               gpu_tests_passed=gpu_passed)
    res['passed'] = a.rc == 0 and not failures and not gpu_skipped and counts['passed'] > 0 and res['gpu_tests_passed'] > 0
    if not res['passed']:
        why = []
        if failures: why.append(f"{len(failures)} failed")
        if gpu_skipped: why.append(f"{len(gpu_skipped)} GPU tests skipped on a GPU machine (see skipped)")
        if not res['gpu_tests_passed']: why.append("no GPU test passed")
        if a.rc not in (0, 1): why.append(f"pytest rc {a.rc}" + (' (timed out)' if a.rc in (124, 137) else ''))
        res['error'] = '; '.join(why) or f"pytest rc {a.rc}"
        res['log_tail'] = tail(a.log)
    dump(a.out, res)
    return 0 if res['passed'] else 1


# ---------------------------------------------------------------- base stage
def build_prose(dest: Path) -> list[str]:
    "The repository's Markdown files (README, CONTRIBUTING, docs/, ...) copied into `dest`: the prose beside pydoc's topics."
    dest.mkdir(parents=True, exist_ok=True)
    listed = _run(['git', 'ls-files', '*.md'], cwd=REPO).splitlines()
    files = [REPO / f for f in listed if (REPO / f).is_file()] or \
        [p for p in REPO.rglob('*.md') if not {'.venv', 'data', 'runs', 'node_modules'} & set(p.relative_to(REPO).parts)]
    out = []
    for p in sorted(files):
        rel = p.relative_to(REPO); name = '__'.join(rel.parts)
        shutil.copyfile(p, dest / name); out.append(str(rel))
    return out


def workspace_params(mode: str, steps: int, prose: Path) -> dict:
    "params.yaml overlaid with profiles/gpu.yaml (as `composer2 workspace gpu` does), then this check's own settings."
    sys.path.insert(0, str(REPO))
    from composer2.config import deep_merge, read_yaml
    p = deep_merge(read_yaml(REPO / 'params.yaml'), read_yaml(REPO / 'profiles' / 'gpu.yaml'))
    if mode == 'dry':                                    # CPU plumbing check: the smoke profile's sizes on top
        smoke = read_yaml(REPO / 'profiles' / 'smoke.yaml')
        p = deep_merge(p, {k: smoke[k] for k in ('data', 'tokenizer', 'model', 'base')})
    code_dirs = [str(REPO / d) for d in ('composer2', 'benchmarks') if (REPO / d).is_dir()]
    p['data'].update(stdlib=True, code_dirs=code_dirs, prose_dirs=[str(prose)], out_dir='data/corpus')
    tr = p['base']['train']
    tr.update(steps=steps, warmup_steps=min(int(tr.get('warmup_steps', 0)), steps // 10), eval_every=steps,
              ckpt_every=0, log_every=10 if steps >= 10 else 1)
    if mode == 'dry':                                    # keep the CPU check quick: small files only, one thread
        p['data']['max_file_bytes'] = 12000; tr.update(threads=1, eval_windows=2)
    return p


def _stage(name, ws, env, timeout, log):
    with open(log, 'a') as f:
        f.write(f"\n==== composer2 stage {name}\n"); f.flush()
        t = time.time()
        r = subprocess.run([sys.executable, '-m', 'composer2.cli', 'stage', name, '--params', 'params.yaml'], cwd=ws, env=env,
                           stdout=f, stderr=subprocess.STDOUT, timeout=max(1, timeout))
    if r.returncode: raise RuntimeError(f"stage {name} exited with {r.returncode} (log: {log})")
    return round(time.time() - t, 2)


def _losses(ws: Path) -> list[float]:
    p = ws / 'reports' / 'live' / 'base' / 'plots' / 'metrics' / 'train' / 'loss.tsv'
    try: rows = p.read_text().splitlines()[1:]
    except OSError: return []
    out = []
    for r in rows:
        parts = r.split('\t')
        try: out.append(float(parts[-1]))
        except (ValueError, IndexError): pass
    return out


def _run_base(ws, env, cap, log):
    "Run the base stage for at most `cap` seconds; returns (rc, capped, losses, steps/s measured between loss rows)."
    with open(log, 'a') as f:
        f.write("\n==== composer2 stage base\n"); f.flush()
        pr = subprocess.Popen([sys.executable, '-m', 'composer2.cli', 'stage', 'base', '--params', 'params.yaml'], cwd=ws,
                              env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        t0, first, last, n_last, capped = time.time(), None, None, 0, False
        while pr.poll() is None:
            time.sleep(0.5)
            n = len(_losses(ws))
            if n != n_last:
                now = time.time()
                if first is None and n >= 2: first = (now, n)
                last, n_last = (now, n), n
            if time.time() - t0 > cap:
                capped = True
                os.killpg(pr.pid, signal.SIGTERM)
                try: pr.wait(15)
                except subprocess.TimeoutExpired: os.killpg(pr.pid, signal.SIGKILL); pr.wait()
    rate = (last[1] - first[1]) / (last[0] - first[0]) if first and last and last[0] > first[0] else None
    return pr.returncode, capped, _losses(ws), rate


def _active_params(mcfg: dict) -> int | None:
    try:
        import torch
        from composer2.model import ModelConfig, Transformer
        with torch.device('meta'): m = Transformer(ModelConfig(**mcfg))
        return int(m.num_params(active=True))
    except Exception: return None


def base(a) -> int:
    work = Path(a.work).resolve(); ws = work / 'ws'
    t0 = time.time(); deadline = t0 + a.budget
    log = work / 'base_stage.log'
    res = {'mode': a.mode, 'passed': False, 'steps_requested': a.steps, 'budget_s': a.budget, 'timings_s': {}, 'log': str(log)}
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [str(REPO), os.environ.get('PYTHONPATH')])), 'TQDM_MININTERVAL': '5'}
    try:
        if ws.exists(): shutil.rmtree(ws)
        ws.mkdir(parents=True)
        res['prose_files'] = build_prose(work / 'prose')
        p = workspace_params(a.mode, a.steps, work / 'prose')
        import yaml
        (ws / 'params.yaml').write_text("# generated by benchmarks/gpu_check.sh: params.yaml + profiles/gpu.yaml + the check's overrides\n"
                                        + yaml.safe_dump(p, sort_keys=False))
        res['data'] = {k: p['data'][k] for k in ('stdlib', 'code_dirs', 'prose_dirs')}
        for name in ('data', 'tokenizer'):
            res['timings_s'][name] = _stage(name, ws, env, deadline - time.time(), log)
        tok = json.loads((ws / 'reports' / 'metrics' / 'tokenizer.json').read_text())
        res['corpus'] = json.loads((ws / 'reports' / 'metrics' / 'data.json').read_text()).get('corpus', {}).get('splits')
        res['tokens'] = {k: v['tokens'] for k, v in tok['splits'].items()}
        if tok['vocab_size'] != p['model']['vocab_size']:   # a small corpus may stop BPE short of the profile's vocabulary
            res['vocab_adjusted'] = {'profile': p['model']['vocab_size'], 'tokenizer': tok['vocab_size']}
            p['model']['vocab_size'] = tok['vocab_size']
            (ws / 'params.yaml').write_text(yaml.safe_dump(p, sort_keys=False))
        tr = p['base']['train']
        res['config'] = {'model': p['model'], 'train': tr}
        cap = deadline - time.time() - 10
        if cap < 20: raise RuntimeError(f"no time left for the base stage ({cap:.0f}s after data and tokenizer)")
        tb = time.time()
        rc, capped, losses, rate = _run_base(ws, env, cap, log)
        res['timings_s']['base'] = round(time.time() - tb, 2)
        res.update(rc=rc, capped=capped, steps_done=len(losses), first_loss=losses[0] if losses else None,
                   last_loss=sum(losses[-10:]) / len(losses[-10:]) if losses else None, steps_per_s=rate,
                   loss_curve={i + 1: round(losses[i], 4) for i in range(0, len(losses), max(1, len(losses) // 20))})
        mpath = ws / 'reports' / 'metrics' / 'base.json'
        if mpath.exists() and not capped: res['metrics'] = json.loads(mpath.read_text())
        active = (res.get('metrics') or {}).get('params_active') or _active_params(p['model'])
        if rate:
            tps = rate * tr['batch_size'] * tr['seq_len']
            res['tokens_per_s'] = tps
            if active: res['params_active'] = active; res['model_tflops'] = 6 * active * tps / 1e12   # 6N per token, attention left out
        min_steps = min(a.steps, 50)
        problems = []
        if rc and not capped: problems.append(f"base stage exited with {rc}")
        if not losses: problems.append("no training loss was logged")
        elif not all(math.isfinite(x) for x in losses): problems.append("a loss is not finite")
        if capped and len(losses) < min_steps: problems.append(f"time cap hit after {len(losses)} steps (< {min_steps})")
        if a.mode == 'gpu' and len(losses) >= 50 and not res['last_loss'] < 0.9 * res['first_loss']:
            problems.append(f"loss did not fall: first {res['first_loss']:.3f}, last-10 mean {res['last_loss']:.3f}")
        if problems: res['error'] = '; '.join(problems)
        res['passed'] = not problems
    except Exception as e:
        res['error'] = f"{type(e).__name__}: {e}"
        res['traceback'] = traceback.format_exc()[-3000:]
    if not res['passed']: res['log_tail'] = tail(log)
    res['wall_s'] = round(time.time() - t0, 2)
    dump(a.out, res)
    return 0 if res['passed'] else 1


# ---------------------------------------------------------------- merge
def merge(a) -> int:
    parts_dir = Path(a.parts)
    envd = json.loads((parts_dir / 'env.json').read_text()) if (parts_dir / 'env.json').exists() else {}
    out = {'schema': 'composer2.gpu_check/1', 'mode': a.mode, 'started_utc': a.started, 'wall_s': a.wall,
           'budget_s': a.budget, 'gpu': envd.get('gpu_name'), 'torch': envd.get('torch'), 'cupy': envd.get('cupy'),
           'env': envd, 'parts': {}}
    for name in a.names:
        run = {}
        rf = parts_dir / f'{name}.run'
        if rf.exists():
            for line in rf.read_text().splitlines():
                k, _, v = line.partition('=')
                run[k] = v
        try: part = json.loads((parts_dir / f'{name}.json').read_text())
        except (OSError, ValueError): part = {'passed': False}
        rc = int(run.get('rc', -1))
        if 'passed' not in part:                          # gpu_bench.py's figures: passed when it ran and every figure is usable
            part['passed'] = rc == 0 and not part.get('problems')
            if part.get('problems'): part['error'] = '; '.join(part['problems'])
        part['cmd'] = run.get('cmd'); part['rc'] = rc; part['wall_s'] = float(run.get('wall_s', 'nan'))
        part['time_limit_s'] = int(run.get('limit_s', 0) or 0)
        if rc in (124, 137): part['timed_out'] = True; part['passed'] = False
        if rc != 0: part['passed'] = False
        if not part['passed'] and not part.get('error'):
            part['error'] = run.get('skipped') or (f"timed out after {part['time_limit_s']}s" if part.get('timed_out') else f"exit code {rc}")
            if run.get('log'): part['log_tail'] = tail(run['log'])
        out['parts'][name] = part
    b, g = out['parts'].get('base_stage', {}), out['parts'].get('gpu_bench', {})
    ref = (g.get('grouped_gemm') or {}).get('bf16_matmul_tflops')
    if b.get('model_tflops') and ref:
        b['model_tflops_x_bf16_matmul'] = b['model_tflops'] / ref   # training FLOP/s against this run's bf16 matmul
    if a.refused:
        out['status'] = 'no_cuda'; code = 2
        out['error'] = envd.get('no_cuda_reason') or envd.get('error') or 'no CUDA device'
    else:
        ok = all(p.get('passed') for p in out['parts'].values()) and bool(out['parts'])
        out['status'] = ('dry_run_passed' if a.mode == 'dry' else 'passed') if ok else 'failed'
        code = 0 if ok else 1
    out['failed_parts'] = [k for k, p in out['parts'].items() if not p.get('passed')]
    out['exit_code'] = code
    dump(a.out, out)
    print(f"gpu_check: {out['status']}" + (f" (failed: {', '.join(out['failed_parts'])})" if out['failed_parts'] and not a.refused else '')
          + f" -> {a.out}")
    return code


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    e = sub.add_parser('env'); e.add_argument('--out', required=True)
    sub.add_parser('tests-files')
    t = sub.add_parser('tests'); t.add_argument('--out', required=True); t.add_argument('--mode', choices=['gpu', 'dry'], required=True)
    t.add_argument('--junit'); t.add_argument('--log', required=True); t.add_argument('--rc', type=int, required=True)
    b = sub.add_parser('base'); b.add_argument('--out', required=True); b.add_argument('--work', required=True)
    b.add_argument('--mode', choices=['gpu', 'dry'], required=True); b.add_argument('--steps', type=int, required=True)
    b.add_argument('--budget', type=float, required=True)
    m = sub.add_parser('merge'); m.add_argument('--out', required=True); m.add_argument('--parts', required=True)
    m.add_argument('--mode', required=True); m.add_argument('--names', nargs='*', default=[]); m.add_argument('--refused', action='store_true')
    m.add_argument('--started', default=''); m.add_argument('--wall', type=float, default=0.0); m.add_argument('--budget', type=int, default=0)
    a = ap.parse_args(argv)
    return {'env': env, 'tests-files': tests_files, 'tests': tests, 'base': base, 'merge': merge}[a.cmd](a)


if __name__ == '__main__':
    sys.exit(main())
