"""Training throughput of the default CPU model with the trainer's pieces (`composer2.train.make_optimizer`: fused
AdamW; `head_ce`: the head and cross entropy in row blocks, as `train` runs them): tokens/s, and achieved FLOP/s as a
fraction of a plain torch matmul's FLOP/s measured in the same run (best of `--repeat` timings of `--steps` optimizer
steps; matmul: best of 10). Also the same step with the full logits and `masked_ce` (the trainer before `head_ce`),
interleaved with it, and the ratio of the two. `python benchmarks/bench_train.py [--steps N] [--repeat R]`."""
import argparse, sys
import torch, torch.nn.functional as F
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time, matmul_flops
from composer2.config import load_section, repo_root
from composer2.model import ModelConfig, Transformer
from composer2.train import TrainConfig, head_ce, make_optimizer, masked_ce

ap = argparse.ArgumentParser(); ap.add_argument('--steps', type=int, default=1); ap.add_argument('--repeat', type=int, default=10); ap.add_argument('--batch', type=int, default=16)
ap.add_argument('--seq', type=int, default=128); ap.add_argument('--threads', type=int, default=2)
a = ap.parse_args()
torch.set_num_threads(a.threads); torch.manual_seed(0)
cfg = load_section(ModelConfig, 'model', repo_root() / 'params.yaml')
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
