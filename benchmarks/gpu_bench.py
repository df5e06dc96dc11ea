"""GPU figures of the low-precision kernels, each against a baseline measured in the same run (one implementation, used
by bench_lowp.py, which prints them, and by gpu_check.sh, which stores them as JSON).

Quantize: composer2.kernels' NVFP4/MXFP8 quantizers and dequantizers in GB/s of fp32 input, as a fraction of a device
copy of the same tensor (`dst.copy_(x)`: read + write of the fp32 input, the bandwidth a fused one-pass quantizer can at
best reach; `x.clone()` is reported beside it). Goal: >= 0.8 x copy.
Grouped GEMM: TFLOP/s of the fp32 SIMT kernel, the NVFP4 SIMT kernel (with and without its quantisation) and, on sm_80+,
the bf16 tensor-core NVFP4 and MXFP8 kernels (grouped_gemm_tc.cu, operands pre-quantised), as a fraction of torch's bf16
matmul of the same FLOPs (one GEMM); torch bf16 with one matmul per expert is reported beside it.

`python benchmarks/gpu_bench.py [--json PATH] [--tiny] [--device cuda|cpu]`: without CUDA (or with --device cpu) the
dispatch functions run composer2.quant's reference path, so `--tiny --device cpu` checks this script's plumbing only;
its figures mean nothing. Times are best of N (`_common.best_time`, synchronised)."""
import argparse, json, math, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import best_time
from composer2 import kernels as KN

QUANT_GOAL = 0.8
FULL = {'quant_shape': (16384, 8192), 'gemm': (16, 16384, 1024, 2048), 'quant_repeat': 20, 'gemm_repeat': 10}
TINY = {'quant_shape': (64, 256), 'gemm': (4, 256, 64, 128), 'quant_repeat': 2, 'gemm_repeat': 2}


def _memo(f):
    "f() on first call, then the same value (operands made inside the timed cases: a failure there is that case's)."
    box = []
    return lambda: box[0] if box else (box.append(f()) or box[0])


def _timed(fn, repeat: int):
    "best_time of `fn`, or the error it raised (one failing kernel leaves the other figures standing)."
    try: return best_time(fn, repeat=repeat), None
    except Exception as e: return None, f"{type(e).__name__}: {e}"[:500]


def quant_figures(dev: str, shape, repeat: int) -> dict:
    "Quantizer/dequantizer GB/s of fp32 input and their ratio to a device copy of the same bytes, same run."
    x = torch.randn(*shape, device=dev)
    nb = x.numel() * 4
    dst = torch.empty_like(x)
    t_copy = best_time(lambda: dst.copy_(x), repeat=repeat)
    t_clone = best_time(lambda: x.clone(), repeat=repeat)
    q4, q8 = _memo(lambda: KN.nvfp4_quantize(x, 'row')), _memo(lambda: KN.mxfp8_quantize(x, 'e4m3', 'rceil'))
    cases = {'nvfp4 row': lambda: KN.nvfp4_quantize(x, 'row'),
             'nvfp4 tensor': lambda: KN.nvfp4_quantize(x, 'tensor'),
             'nvfp4 16x16': lambda: KN.nvfp4_quantize(x, 'tensor', block2d=True),
             'nvfp4 row + SR': lambda: KN.nvfp4_quantize(x, 'row', sr=True),
             'mxfp8 e4m3 rceil': lambda: KN.mxfp8_quantize(x, 'e4m3', 'rceil'),
             'mxfp8 e5m2 floor': lambda: KN.mxfp8_quantize(x, 'e5m2', 'floor'),
             'nvfp4 dequantize': lambda: KN.nvfp4_dequantize(q4()),
             'mxfp8 dequantize': lambda: KN.mxfp8_dequantize(q8())}
    kernels = {}
    for name, fn in cases.items():
        t, err = _timed(fn, repeat)
        kernels[name] = {'error': err} if err else {'gbs': nb / t / 1e9, 'x_copy': t_copy / t, 'x_clone': t_clone / t}
    quantizers = [v['x_copy'] for k, v in kernels.items() if 'dequantize' not in k and 'x_copy' in v]
    return {'shape': list(shape), 'bytes': nb, 'copy_gbs': nb / t_copy / 1e9, 'clone_gbs': nb / t_clone / 1e9,
            'kernels': kernels, 'goal_x_copy': QUANT_GOAL, 'min_quantize_x_copy': min(quantizers, default=None),
            'goal_met': bool(quantizers) and min(quantizers) >= QUANT_GOAL}


def gemm_figures(dev: str, E: int, N: int, d: int, h: int, repeat: int) -> dict:
    "Grouped-GEMM TFLOP/s and their ratio to torch's bf16 matmul of the same FLOPs, same run."
    g = torch.Generator(device=dev).manual_seed(0)
    xs = torch.randn(N, d, device=dev, generator=g); w = torch.randn(E, h, d, device=dev, generator=g) / 32
    counts = [N // E] * E
    flops = 2 * N * d * h
    a16, b16 = torch.randn(N, d, device=dev, dtype=torch.bfloat16), torch.randn(d, h, device=dev, dtype=torch.bfloat16)
    t_bf16 = best_time(lambda: a16 @ b16, repeat=repeat * 2)
    a16s, w16 = xs.bfloat16(), w.bfloat16()
    offs = [sum(counts[:e]) for e in range(E)]
    nv = _memo(lambda: (KN.nvfp4_quantize(xs, 'row'), KN.quantize_experts_nvfp4(w)))     # pre-quantised operands
    mx = _memo(lambda: (KN.mxfp8_quantize(xs, 'e4m3'), KN.mxfp8_quantize(w, 'e4m3')))
    tc = dev == 'cpu' or torch.cuda.get_device_capability() >= KN.TC_MIN_CAPABILITY   # CPU: the reference path, plumbing only
    cases = {'torch bf16, one matmul per expert': lambda: [a16s[o:o + n] @ w16[e].t() for e, (o, n) in enumerate(zip(offs, counts))],
             'grouped_gemm fp32 (SIMT)': lambda: KN.grouped_gemm(xs, w, counts),
             'nvfp4_grouped_gemm (quantise + default kernel)': lambda: KN.nvfp4_grouped_gemm(xs, w, counts),
             'nvfp4 SIMT (pre-quantised)': lambda: KN.nvfp4_grouped_gemm_q(*nv(), counts, tensor_cores=False)}
    if tc:
        cases['nvfp4 tensor cores (pre-quantised)'] = lambda: KN.nvfp4_grouped_gemm_q(*nv(), counts, tensor_cores=True)
        cases['mxfp8 e4m3 tensor cores (pre-quantised)'] = lambda: KN.mxfp8_grouped_gemm_q(*mx(), counts, tensor_cores=True)
    kernels = {}
    for name, fn in cases.items():
        t, err = _timed(fn, repeat)
        kernels[name] = {'error': err} if err else {'tflops': flops / t / 1e12, 'x_bf16_matmul': t_bf16 / t}
    return {'experts': E, 'rows': N, 'd_in': d, 'd_out': h, 'flops': flops, 'bf16_matmul_tflops': flops / t_bf16 / 1e12,
            'tensor_cores': tc, 'kernels': kernels}


def gpu_figures(dev: str = 'cuda', tiny: bool = False) -> dict:
    "Every figure of this benchmark on `dev`, with the device and versions it ran on."
    s = TINY if tiny else FULL
    t0 = time.time()
    out = {'device': dev, 'kernels_used': KN.cuda_available() and dev != 'cpu', 'tiny': tiny, 'torch': torch.__version__}
    if dev != 'cpu':
        out['gpu'] = torch.cuda.get_device_name()
        out['capability'] = 'sm_%d%d' % torch.cuda.get_device_capability()
    out['quantize'] = quant_figures(dev, s['quant_shape'], s['quant_repeat'])
    out['grouped_gemm'] = gemm_figures(dev, *s['gemm'], s['gemm_repeat'])
    out['wall_s'] = time.time() - t0
    return out


def check_figures(fig: dict) -> list:
    "Problems with a figures dict (non-finite or non-positive rates): empty when every figure is usable."
    bad = []
    for part, key in (('quantize', 'gbs'), ('grouped_gemm', 'tflops')):
        for name, v in fig[part]['kernels'].items():
            if 'error' in v: bad.append(f"{part} {name}: {v['error']}")
            elif not (math.isfinite(v[key]) and v[key] > 0): bad.append(f"{part} {name}: {key} = {v[key]}")
    return bad


def print_figures(fig: dict):
    q, g = fig['quantize'], fig['grouped_gemm']
    print(f"GPU {fig.get('gpu', fig['device'])}: x fp32 {q['shape']}: device copy (copy_) {q['copy_gbs']:.0f} GB/s, clone {q['clone_gbs']:.0f} GB/s")
    for name, v in q['kernels'].items():
        if 'error' in v: print(f"  {name:18s} FAILED: {v['error']}"); continue
        print(f"  {name:18s} {v['gbs']:8.0f} GB/s of fp32 = {v['x_copy']:5.2f} x device copy (goal >= {QUANT_GOAL})")
    print(f"grouped GEMM, {g['experts']} experts x {g['rows'] // g['experts']} rows, {g['d_in']} -> {g['d_out']}: "
          f"torch bf16 matmul (one GEMM, same FLOPs) {g['bf16_matmul_tflops']:.1f} TFLOP/s")
    for name, v in g['kernels'].items():
        if 'error' in v: print(f"  {name:46s} FAILED: {v['error']}"); continue
        print(f"  {name:46s} {v['tflops']:7.2f} TFLOP/s = {v['x_bf16_matmul']:.3f} x bf16 matmul")
    if not g['tensor_cores']: print(f"  tensor-core grouped GEMMs need sm_80+; this device is {fig.get('capability')}")


if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--json', default=None, help='write the figures here as JSON')
    ap.add_argument('--tiny', action='store_true', help='tiny shapes and 2 repeats (a plumbing check)')
    ap.add_argument('--device', default='cuda', choices=['cuda', 'cpu'])
    a = ap.parse_args()
    if a.device == 'cuda' and not KN.cuda_available():
        print("gpu_bench: no CUDA device (or cupy missing): run with --device cpu for a plumbing check", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(0)
    fig = gpu_figures(a.device, a.tiny)
    fig['problems'] = check_figures(fig)
    print_figures(fig)
    if a.json: Path(a.json).write_text(json.dumps(fig, indent=1))
    sys.exit(1 if fig['problems'] else 0)
