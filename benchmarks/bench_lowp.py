"""The low-precision training step against the high-precision one, quantizer throughput against memory copy,
measured in the same run, and (on a GPU) the grouped expert GEMM against
torch bf16 matmul. `python benchmarks/bench_lowp.py [--size MiB]`.

Step: one training step (forward, backward, AdamW) of params.yaml's `model:` at batch 16x128, precision
'nvfp4_mxfp8' (with params.yaml's lowp.quant switches) against precision 'high', on lowp.train.threads threads:
`RATIO lowp/high step time` (goal <= 2x).
CPU: composer2.quant's reference quantizers and the fused numba ones (fast_fake_quant_*) (NVFP4 row/tensor/16x16, MXFP8 E4M3/E5M2, with and without stochastic
rounding) in GB/s of fp32 input read, as a fraction of `dst.copy_(src)` of the same tensor (read + write of the fp32
input: the bandwidth a fused one-pass quantizer could at best reach). The reference is a chain of torch elementwise
ops, so expect a small fraction; the CUDA kernels are the fused path.
GPU (skipped without CUDA + cupy): benchmarks/gpu_bench.py's figures (also stored by benchmarks/gpu_check.sh):
composer2.kernels quantize GB/s as a fraction of a device-to-device copy (goal >= 0.8), and grouped-GEMM TFLOP/s
against torch bf16 matmul in the same run (one GEMM of the same total FLOPs, and one matmul per expert of the same
grouped shapes): the fp32 SIMT and NVFP4-operand SIMT kernels (including their quantisation), then on pre-quantised
operands the NVFP4 SIMT kernel and, on sm_80+, the bf16 tensor-core NVFP4 and MXFP8 kernels (grouped_gemm_tc.cu;
dequantise code x block scale to bf16 in shared memory, fp32 accumulation)."""
import argparse, sys
import torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2 import quant as Q

ap = argparse.ArgumentParser()
ap.add_argument('--size', type=float, default=16.0, help='fp32 input size in MiB (CPU)')
ap.add_argument('--threads', type=int, default=2)
ap.add_argument('--steps', type=int, default=3, help='timed training steps per precision (best of)')
args = ap.parse_args()
torch.manual_seed(0)

import yaml
import torch.nn.functional as F
from composer2.lowp import lowp_config
from composer2.model import ModelConfig, Transformer
P = yaml.safe_load(open(__file__.rsplit('/', 2)[0] + '/params.yaml'))
torch.set_num_threads(P['lowp']['train']['threads'])
ids = torch.randint(0, P['model']['vocab_size'], (16, 129), generator=torch.Generator().manual_seed(0))

def step_time(prec):
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**{**P['model'], 'precision': prec})); opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    def step():
        out = m(ids[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + 0.01 * out.aux_loss
        opt.zero_grad(); loss.backward(); opt.step()
    return best_time(step, repeat=args.steps)

with lowp_config(**P['lowp']['quant']):
    t_hi, t_lo = step_time('high'), step_time('nvfp4_mxfp8')
    t_hi = min(t_hi, step_time('high'))                       # interleaved: noise on a shared machine hits both arms
print(f"training step, model {P['model']['d_model']}d x {P['model']['n_layers']} layers, batch 16x128, "
      f"{torch.get_num_threads()} thread(s): high {t_hi * 1e3:.0f} ms, nvfp4_mxfp8 {t_lo * 1e3:.0f} ms")
print(f"RATIO lowp/high step time = {t_lo / t_hi:.2f}x (goal <= 2x)")
torch.set_num_threads(args.threads)

K = 4096
R = max(1, int(args.size * 2 ** 20 / 4 / K))
x = torch.randn(R, K)
nbytes = x.numel() * 4
dst = torch.empty_like(x)
t_copy = best_time(lambda: dst.copy_(x), repeat=7)
copy_gbs = nbytes / t_copy / 1e9
print(f"CPU, {args.threads} threads, x fp32 [{R}, {K}] ({nbytes / 2 ** 20:.0f} MiB): memcpy (copy_) {copy_gbs:.2f} GB/s")
cases = {
    'nvfp4 row (1x16)': lambda: Q.quantize_nvfp4(x, 'row'),
    'nvfp4 tensor (1x16)': lambda: Q.quantize_nvfp4(x, 'tensor'),
    'nvfp4 tensor 16x16': lambda: Q.quantize_nvfp4(x, 'tensor', block2d=True),
    'nvfp4 row + SR': lambda: Q.quantize_nvfp4(x, 'row', sr=True),
    'mxfp8 e4m3 floor': lambda: Q.quantize_mxfp8(x, 'e4m3', 'floor'),
    'mxfp8 e5m2 rceil': lambda: Q.quantize_mxfp8(x, 'e5m2', 'rceil'),
    'mxfp8 e4m3 rceil + SR': lambda: Q.quantize_mxfp8(x, 'e4m3', 'rceil', sr=True),
    'random Hadamard (16)': lambda: Q.rht(x, -1),
    'fused nvfp4 row (fake)': lambda: Q.fast_fake_quant_nvfp4(x, 'row'),
    'fused nvfp4 tensor 16x16': lambda: Q.fast_fake_quant_nvfp4(x, 'tensor', block2d=True),
    'fused mxfp8 e4m3 rceil': lambda: Q.fast_fake_quant_mxfp8(x, 'e4m3', 'rceil'),
    'fused mxfp8 e4m3 rc + SR': lambda: Q.fast_fake_quant_mxfp8(x, 'e4m3', 'rceil', sr=True),
    'torch.rand (peer)': lambda: torch.rand(x.shape),
    'sr_uniforms (torch)': lambda: Q.sr_uniforms(1, tuple(x.shape)),
}
for name, fn in cases.items():
    t = best_time(fn, repeat=3)
    print(f"  {name:26s} {nbytes / t / 1e9:7.3f} GB/s = {t_copy / t:6.3f} x memcpy")
    if name.startswith('fused'): print(f"RATIO {name.replace(' ', '_')} / memcpy = {t_copy / t:.3f}x")

from composer2 import kernels as KN
if not KN.cuda_available():
    print("GPU: no CUDA device (or no cupy): kernel benchmarks not run")
    sys.exit(0)
from gpu_bench import gpu_figures, print_figures            # the GPU figures: one implementation, shared with gpu_check.sh
print_figures(gpu_figures('cuda'))
