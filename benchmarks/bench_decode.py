"""KV-cached decoding against uncached decoding (re-running the whole prefix every token), same model, same run.
`python benchmarks/bench_decode.py`."""
import sys, time
import torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2.config import load_section, repo_root
from composer2.model import ModelConfig, Transformer, generate

torch.set_num_threads(2); torch.manual_seed(0)
cfg = load_section(ModelConfig, 'model', repo_root() / 'params.yaml'); cfg.max_seq_len = 1024
m = Transformer(cfg).eval()
for B, P, N in [(1, 64, 64), (8, 64, 64), (1, 512, 64)]:
    prompts = [torch.randint(0, cfg.vocab_size, (P,)).tolist() for _ in range(B)]
    @torch.no_grad()
    def uncached():
        seq = torch.tensor(prompts)
        for _ in range(N): seq = torch.cat([seq, m(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        return seq
    cached = lambda: generate(m, prompts, max_new_tokens=N)
    assert [r[P:] for r in uncached().tolist()] == cached().tokens   # same tokens, or the comparison means nothing
    tc, tu = best_time(cached, repeat=3), best_time(uncached, repeat=3)
    print(f"batch {B}, prompt {P}, {N} new tokens: cached {B*N/tc:,.0f} tok/s, uncached {B*N/tu:,.0f} tok/s")
    print(f"RATIO cached/uncached = {tu / tc:.2f}x")
