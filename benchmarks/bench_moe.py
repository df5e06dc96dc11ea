"""The MoE layer's sorted, dropless dispatch against two naive baselines measured in the same run: a per-expert loop
over boolean masks, and computing every expert on every token. Forward + backward. `python benchmarks/bench_moe.py`."""
import sys
import torch, torch.nn.functional as F
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2.model import ModelConfig, MoE

torch.set_num_threads(2); torch.manual_seed(0)
for E, k, tokens in [(8, 2, 2048), (32, 4, 2048)]:
    cfg = ModelConfig(d_model=128, n_heads=4, n_kv_heads=2, n_experts=E, top_k=k, d_expert=256, n_shared_experts=0)
    moe = MoE(cfg); x = torch.randn(1, tokens, 128, requires_grad=True)
    def ours(): moe(x)[0].sum().backward()
    def masked_loop():
        s = moe.scores(x); idx = s.topk(k, -1).indices; g = s.gather(-1, idx); g = g / g.sum(-1, keepdim=True)
        xf, out = x.reshape(-1, 128), torch.zeros(tokens, 128)
        for e in range(E):
            hit = (idx.reshape(-1, k) == e)
            rows = hit.any(-1).nonzero()[:, 0]
            if len(rows) == 0: continue
            h = F.silu(xf[rows] @ moe.w1[e].t()) * (xf[rows] @ moe.w3[e].t())
            out = out.index_add(0, rows, (h @ moe.w2[e].t()) * (g.reshape(-1, k)[rows] * hit[rows]).sum(-1, keepdim=True))
        out.sum().backward()
    def dense_all():
        s = moe.scores(x); idx = s.topk(k, -1).indices
        gates = torch.zeros_like(s).scatter(-1, idx, s.gather(-1, idx)); gates = gates / gates.sum(-1, keepdim=True)
        h = F.silu(torch.einsum('btd,ehd->bteh', x, moe.w1)) * torch.einsum('btd,ehd->bteh', x, moe.w3)
        (torch.einsum('bteh,edh->bted', h, moe.w2) * gates[..., None]).sum(2).sum().backward()
    t_ours, t_mask, t_dense = best_time(ours), best_time(masked_loop), best_time(dense_all)
    print(f"E={E} top-{k}, {tokens} tokens: sorted dispatch {t_ours*1e3:.1f} ms | masked per-expert loop {t_mask*1e3:.1f} ms | every expert on every token {t_dense*1e3:.1f} ms")
    print(f"RATIO speedup vs masked loop = {t_mask / t_ours:.2f}x, vs dense = {t_dense / t_ours:.2f}x")
