"""benchmarks/gpu_check.sh on a machine without a GPU: it refuses (exit 2, a message naming the problem, and still its
JSON summary), its --dry-run checks every part's plumbing (the CUDA test files are found and collect, gpu_bench.py runs
on the CPU at tiny sizes, the base part builds its corpus, tokenizer and workspace and trains 2 steps at the smoke
profile's sizes), and the summary marks a failing or timed-out part failed without hiding the others."""
import json, math, os, subprocess, sys

from conftest import ROOT

SCRIPT = ROOT / 'benchmarks' / 'gpu_check.sh'
sys.path.insert(0, str(ROOT / 'benchmarks'))
import _gpu_check as G


def _run(args, cwd, **env):
    e = {**os.environ, 'PYTHON': sys.executable, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': '', **env}
    return subprocess.run(['bash', str(SCRIPT), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)


def test_refuses_without_a_gpu(tmp_path):
    r = _run([], tmp_path, OUT=str(tmp_path / 'out'))          # the JSON goes to $OUT/gpu_check.json by default
    assert r.returncode == 2, r.stdout + r.stderr
    assert 'refusing to run: no CUDA device' in r.stderr and 'CUDA_VISIBLE_DEVICES is empty' in r.stderr
    d = json.loads((tmp_path / 'out' / 'gpu_check.json').read_text())
    assert d['status'] == 'no_cuda' and d['exit_code'] == 2 and d['parts'] == {}
    assert d['env']['cuda_available'] is False and d['env']['torch'] and 'CUDA_VISIBLE_DEVICES' in d['error']


def test_dry_run_checks_every_part(tmp_path):
    out = tmp_path / 'summary.json'
    r = _run(['--dry-run', '--json', str(out), '--workdir', str(tmp_path / 'work')], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d['status'] == 'dry_run_passed' and d['mode'] == 'dry' and d['exit_code'] == 0 and not d['failed_parts']
    assert set(d['parts']) == {'cuda_tests', 'gpu_bench', 'base_stage'}
    for p in d['parts'].values(): assert p['passed'] and p['rc'] == 0 and p['wall_s'] >= 0
    t = d['parts']['cuda_tests']
    assert 'tests/test_kernels.py' in t['files'] and 'tests/test_gpu_check.py' not in t['files']
    assert t['gpu_tests_collected'] >= 5 and t['collected'] > t['gpu_tests_collected']
    b = d['parts']['gpu_bench']
    assert {'nvfp4 row', 'mxfp8 e4m3 rceil'} <= set(b['quantize']['kernels']) and b['quantize']['copy_gbs'] > 0
    assert 'nvfp4 tensor cores (pre-quantised)' in b['grouped_gemm']['kernels'] and b['grouped_gemm']['bf16_matmul_tflops'] > 0
    assert all(math.isfinite(v['x_bf16_matmul']) for v in b['grouped_gemm']['kernels'].values())
    s = d['parts']['base_stage']
    assert s['steps_done'] == 2 and all(math.isfinite(x) for x in (s['first_loss'], s['last_loss']))
    assert s['data']['stdlib'] and any(c.endswith('composer2') for c in s['data']['code_dirs']) and 'README.md' in s['prose_files']
    assert min(s['tokens'].values()) > 0 and set(s['timings_s']) == {'data', 'tokenizer', 'base'}
    assert s['config']['model']['n_experts'] == 4 and s['config']['train']['precision'] == 'bf16'   # smoke sizes, gpu profile's bf16


def test_summary_marks_failed_and_timed_out_parts(tmp_path):
    parts = tmp_path / 'parts'; parts.mkdir()
    (parts / 'env.json').write_text(json.dumps({'gpu_name': 'X', 'torch': '0'}))
    (parts / 'a.run').write_text('rc=0\nwall_s=1.5\nlimit_s=10\ncmd=a\n')
    (parts / 'a.json').write_text(json.dumps({'passed': True}))
    (parts / 'b.run').write_text(f'rc=124\nwall_s=10\nlimit_s=10\ncmd=b\nlog={tmp_path / "b.log"}\n')
    (tmp_path / 'b.log').write_text('last words')
    (parts / 'c.run').write_text('rc=1\nwall_s=2\nlimit_s=10\ncmd=c\n')
    (parts / 'c.json').write_text(json.dumps({'quantize': {}, 'problems': ['nvfp4 row: gbs = nan']}))   # gpu_bench.py's shape
    out = tmp_path / 's.json'
    code = G.main(['merge', '--out', str(out), '--parts', str(parts), '--mode', 'gpu', '--names', 'a', 'b', 'c'])
    d = json.loads(out.read_text())
    assert code == 1 and d['status'] == 'failed' and d['failed_parts'] == ['b', 'c'] and d['parts']['a']['passed']
    assert d['parts']['b']['timed_out'] and 'timed out after 10s' in d['parts']['b']['error'] and d['parts']['b']['log_tail'] == 'last words'
    assert d['parts']['c']['error'] == 'nvfp4 row: gbs = nan'
