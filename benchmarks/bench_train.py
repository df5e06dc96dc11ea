"""Training throughput of the default CPU model with the trainer's pieces (`composer2.train.make_optimizer`: fused
AdamW; `head_ce`: the head and cross entropy in row blocks, as `train` runs them): tokens/s, and achieved FLOP/s as a
fraction of a plain torch matmul's FLOP/s measured in the same run (best of `--repeat` timings of `--steps` optimizer
steps; matmul: best of 10). Also the same step with the full logits and `masked_ce` (the trainer before `head_ce`),
interleaved with it, and the ratio of the two. Then the ceiling: the step's GEMMs (`step_gemms`) timed alone as plain
`torch.mm` calls at the same shapes, their share of the step's time and their rate against the matmul's. `--trainer N` also times `composer2.train.train` itself for N steps,
both ways, three runs each interleaved, each run in a fresh process as a pipeline stage runs it: the trainer keeps each
step's last forward output alive into the next step (32 MB of logits at 16 x 128 on the full-logits path), and a fresh
process's allocator hands out such buffers as new pages, neither of which a bare step loop in a warmed process shows.
`python benchmarks/bench_train.py [--steps N] [--repeat R] [--trainer N]`."""
import argparse, sys
import torch, torch.nn.functional as F
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time, matmul_flops
from composer2.config import load_section, repo_root
from composer2.model import ModelConfig, Transformer
from composer2.train import TrainConfig, head_ce, make_optimizer, masked_ce

ap = argparse.ArgumentParser(); ap.add_argument('--steps', type=int, default=1); ap.add_argument('--repeat', type=int, default=10); ap.add_argument('--batch', type=int, default=16)
ap.add_argument('--seq', type=int, default=128); ap.add_argument('--threads', type=int, default=2)
ap.add_argument('--trainer', type=int, default=0, help='also time train() for this many steps, head in blocks vs full logits')
ap.add_argument('--arm', choices=['full', 'blocked'], help=argparse.SUPPRESS)      # a child process: one trainer run
a = ap.parse_args()
torch.set_num_threads(a.threads); torch.manual_seed(0)
cfg = load_section(ModelConfig, 'model', repo_root() / 'params.yaml')
def trainer_run(blocked: bool, steps: int) -> float:
    """`composer2.train.train` for `steps` steps of the default model (batch --batch x --seq, random tokens). The
    full-logits arm rebinds `composer2.train.Transformer` for the run, so the single-process step's isinstance test fails
    and it takes `masked_ce` over full logits: the trainer as it was before `head_ce`."""
    import tempfile, time, numpy as np
    import composer2.train as T
    torch.manual_seed(0); model = Transformer(cfg)
    stream = np.random.default_rng(0).integers(0, cfg.vocab_size, 400_000).astype(np.uint16)
    tc = TrainConfig(steps=steps, batch_size=a.batch, seq_len=a.seq, lr=1e-3, warmup_steps=2, eval_every=10**6)
    old = T.Transformer
    if not blocked: T.Transformer = type('NotATransformer', (), {})
    try:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter(); T.train(model, tc, T.WindowSampler(stream, a.seq, a.batch, seed=1), d, stage='bench')
            return time.perf_counter() - t0
    finally: T.Transformer = old

if a.arm:                      # a child process (`--trainer`): one train() run, then its seconds on the last line
    print(trainer_run(a.arm == 'blocked', a.trainer)); sys.exit(0)
m = Transformer(cfg); opt, _ = make_optimizer(m, TrainConfig(lr=1e-3))
x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
def step(blocked=True):
    for _ in range(a.steps):
        if blocked: out = m(x, head=False); s = head_ce(out.head_in, m.head.weight, x, torch.ones_like(x))[0]
        else: out = m(x); s = masked_ce(out.logits, x, torch.ones_like(x))[0]
        loss = s / x.numel() + 0.01 * out.aux_loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
t, t_full = float('inf'), float('inf')
for _ in range(a.repeat):      # best of --repeat timings of --steps steps, the two arms interleaved: the machine is noisy
    t = min(t, best_time(step, repeat=1) / a.steps); t_full = min(t_full, best_time(lambda: step(False), repeat=1) / a.steps)
tokens = a.batch * a.seq
# 6 FLOPs per active parameter per token (forward + backward), plus attention's 12·L·d·T per token
attn = 12 * cfg.n_layers * cfg.d_model * a.seq
flops = (6 * m.num_params(active=True) + attn) * tokens / t
base = matmul_flops(512)
print(f"model: {m.num_params()/1e6:.2f}M params, {m.num_params(True)/1e6:.2f}M active; batch {a.batch}x{a.seq}, {a.threads} threads")
print(f"training: {tokens / t:,.0f} tokens/s, {flops / 1e9:.2f} GFLOP/s achieved")
print(f"torch fp32 matmul 512^3 in the same run: {base / 1e9:.2f} GFLOP/s")
print(f"RATIO achieved/matmul = {flops / base:.3f}")
print(f"full logits + masked_ce: {tokens / t_full:,.0f} tokens/s; RATIO full-logits step time / head_ce step time = {t_full / t:.2f}x")

def step_gemms(B, T):
    """(M, K, N, count) of every GEMM of one training step of the default model, forward then dgrad and wgrad: separate
    q/k/v/o projections, the router, the experts' fused gate|up and down GEMMs over perfectly balanced experts, the
    shared expert's three, attention's two per (batch row, head), the head in `head_ce`'s 512-row blocks."""
    n, d, h, E, k = B * T, cfg.d_model, cfg.d_expert, cfg.n_experts, cfg.top_k
    hd, nh, nkv, hs = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_shared or cfg.d_expert * cfg.n_shared_experts
    fwd = []
    for _ in range(cfg.n_layers):
        fwd += [(n, d, nh * hd, 1), (n, d, nkv * hd, 2), (n, nh * hd, d, 1), (n, d, E, 1),
                (n * k // E, d, 2 * h, E), (n * k // E, h, d, E), (n, d, hs, 2), (n, hs, d, 1),
                (T, hd, T, B * nh), (T, T, hd, B * nh)]
    fwd += [(min(512, n), d, cfg.vocab_size, -(-n // 512))]
    return [g for (M, K, N, c) in fwd for g in ((M, K, N, c), (M, N, K, c), (K, M, N, c))]

# The ceiling this ratio can reach: the same GEMMs as plain torch.mm calls at the step's shapes, nothing else.
from collections import Counter
shapes = Counter()
for (M, K, N, c) in step_gemms(a.batch, a.seq): shapes[M, K, N] += c      # each distinct shape timed once
g_t = g_f = 0.0
for (M, K, N), c in shapes.items():
    A, Bm, O = torch.randn(M, K), torch.randn(K, N), torch.empty(M, N)
    g_t += c * best_time(lambda: torch.mm(A, Bm, out=O), repeat=10, warmup=2); g_f += c * 2 * M * K * N
print(f"the step's GEMMs alone (plain torch.mm at its shapes, balanced experts): {g_f / 1e9:.2f} GFLOP in {g_t * 1e3:.1f} ms, "
      f"{g_t / t:.0%} of the step's {t * 1e3:.1f} ms; RATIO GEMMs-alone rate/matmul = {g_f / g_t / base:.3f}")

if a.trainer:
    import subprocess
    runs = {False: [], True: []}
    for _ in range(3):
        for blocked in (False, True):
            argv = [sys.executable, __file__, '--arm', 'blocked' if blocked else 'full', '--trainer', str(a.trainer),
                    '--batch', str(a.batch), '--seq', str(a.seq), '--threads', str(a.threads)]
            out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.split()
            runs[blocked].append(float(out[-1]))
    print(f"train() for {a.trainer} steps, 3 runs each, interleaved: full logits {', '.join(f'{t:.1f}' for t in runs[False])} s; "
          f"head in blocks {', '.join(f'{t:.1f}' for t in runs[True])} s")
    print(f"RATIO train() full-logits / head-in-blocks (best of 3 each) = {min(runs[False]) / min(runs[True]):.2f}x")
