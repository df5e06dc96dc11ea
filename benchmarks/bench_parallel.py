"""Step time (forward + backward + gradient all-reduce) against CP and EP degree, on local gloo processes.

Every figure is a ratio to the CP=1 / EP=1 step measured in the same run, with the same global batch:
- CP=W: W ranks share each sequence (zigzag ring attention, `cp_forward`), gradients summed over the CP group;
- EP=W: W data-parallel ranks each take 1/W of the batch and shard the experts W ways (`EPMoE`, all-to-all).
Alongside the step time, each CP rank reports the bytes autograd saves for backward (activation memory): of the
ring-attention op alone (q/k/v/out/lse of its shard) and of the whole model forward (parameters excluded); the ratio
to CP=1 shows the per-rank activation memory falling as 1/CP.
Each process uses one intra-op thread, so W ranks use W cores: on a machine with fewer free cores than W the
ratios measure contention, not parallel speed-up (the script prints the core count).

    .venv/bin/python benchmarks/bench_parallel.py                 # seq 1024, degrees 1 2
    .venv/bin/python benchmarks/bench_parallel.py --seq 2048 --degrees 1 2 4 --steps 5

Under a launcher (torchrun, deepspeed: RANK/WORLD_SIZE set) it instead runs in the launched group: a ring-attention
self-check against SDPA and one CP step over all ranks (nccl when CUDA is available, else gloo), e.g.

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/bench_parallel.py --seq 256
    .venv/bin/deepspeed --num_gpus 2 benchmarks/bench_parallel.py --seq 256
"""
import argparse, json, os, statistics, sys, time

import torch
import torch.nn.functional as F

from composer2.model import ModelConfig, Transformer
from composer2.parallel import (spawn_local, cp_forward, allreduce_grads, shard_experts, check_ring_attention, ring_attention,
                                zigzag_shard)

def _cfg(a): return ModelConfig(vocab_size=4096, d_model=a.d_model, n_layers=a.layers, n_heads=4, n_kv_heads=2,
                                max_seq_len=max(a.seq, 256), n_experts=8, top_k=2, d_expert=2 * a.d_model, aux_loss_coef=0.0)

def _timed(step, steps):
    step()                                               # warm-up
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)

def _activation_bytes(fn, params=()):
    "Bytes of the tensors autograd saves while running `fn()`, not counting those sharing storage with `params`."
    own = {p.untyped_storage().data_ptr() for p in params}
    n = [0]
    def pack(t):
        if t.untyped_storage().data_ptr() not in own: n[0] += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return n[0]

def cp_rank(rank, world, a):
    torch.manual_seed(0); model = Transformer(_cfg(a))
    ids = torch.randint(0, 4096, (a.batch, a.seq), generator=torch.Generator().manual_seed(1))
    def step():
        model.zero_grad(set_to_none=True)
        cp_forward(model, ids).loss.backward()
        allreduce_grads(model.parameters(), None, 'sum')
    t = _timed(step, a.steps)
    hd = a.d_model // 4
    q, k, v = (zigzag_shard(torch.randn(a.batch, h, a.seq, hd), rank, world, 2).requires_grad_() for h in (4, 2, 2))
    attn = _activation_bytes(lambda: ring_attention(q, k, v, causal=True, seq_len=a.seq))
    model_b = _activation_bytes(lambda: cp_forward(model, ids).loss, list(model.parameters()))
    return dict(seconds=t, attn_bytes=attn, model_bytes=model_b)

def ep_rank(rank, world, a):
    torch.manual_seed(0); model = Transformer(_cfg(a))
    if world > 1: shard_experts(model, None)
    ids = torch.randint(0, 4096, (a.batch * 2, a.seq), generator=torch.Generator().manual_seed(1))
    n = ids.shape[0] // world; mine = ids[rank * n:(rank + 1) * n]
    def step():
        model.zero_grad(set_to_none=True)
        lg = model(mine).logits
        (F.cross_entropy(lg[:, :-1].reshape(-1, 4096), mine[:, 1:].reshape(-1)) / world).backward()
        experts = {id(p) for l in model.layers if l.is_moe for p in (l.ffn.w13, l.ffn.w2)} if world > 1 else set()
        allreduce_grads([p for p in model.parameters() if id(p) not in experts], None, 'sum')
    return dict(seconds=_timed(step, a.steps))

def launched(a):
    "Run under torchrun/deepspeed: self-check and a CP step over the launched world; rank 0 prints."
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda: torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    dist.init_process_group('nccl' if cuda else 'gloo')
    torch.set_num_threads(1)
    r, W = dist.get_rank(), dist.get_world_size()
    chk = check_ring_attention(r, W, T=4 * W + 3, device='cuda' if cuda else 'cpu')
    t = cp_rank(r, W, a)['seconds']
    res = [None] * W; dist.all_gather_object(res, (chk, t))
    if r == 0:
        print(f"launched world {W} ({'nccl' if cuda else 'gloo'}): ring attention max errors "
              f"out {max(c['out_err'] for c, _ in res):.2e}, grad {max(c['grad_err'] for c, _ in res):.2e}; "
              f"CP={W} step {max(s for _, s in res):.3f} s")
    dist.destroy_process_group()

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--seq', type=int, default=1024); ap.add_argument('--batch', type=int, default=2)
    ap.add_argument('--d-model', type=int, default=128); ap.add_argument('--layers', type=int, default=2)
    ap.add_argument('--steps', type=int, default=3); ap.add_argument('--degrees', type=int, nargs='+', default=[1, 2])
    ap.add_argument('--json', default='', help='also write the results here')
    ap.add_argument('--local_rank', type=int, default=0, help='set by the deepspeed launcher (LOCAL_RANK is used)')
    a = ap.parse_args(argv)
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ: return launched(a)
    if 1 not in a.degrees: a.degrees = [1] + a.degrees
    print(f"cores: {os.cpu_count()} | seq {a.seq}, batch {a.batch} (EP: global batch {2 * a.batch}), d_model {a.d_model}, "
          f"{a.layers} layers, 8 experts top-2, median of {a.steps} steps")
    res = {}
    for kind, fn in (('cp', cp_rank), ('ep', ep_rank)):
        for W in a.degrees:
            if kind == 'ep' and 8 % W: continue
            rs = spawn_local(fn, W, a)
            res[(kind, W)] = {k: max(r[k] for r in rs) for k in rs[0]}    # the step ends when the slowest rank ends
    out = {}
    for kind in ('cp', 'ep'):
        base = res[(kind, 1)]
        for W in a.degrees:
            if (kind, W) not in res: continue
            r = res[(kind, W)]
            o = out[f'{kind}{W}'] = dict(seconds=r['seconds'], ratio=r['seconds'] / base['seconds'])
            line = f"{kind.upper()}={W}: step {r['seconds']:.3f} s  ratio to {kind.upper()}=1: {o['ratio']:.2f}"
            if kind == 'cp':
                for m in ('attn_bytes', 'model_bytes'): o[m], o[m + '_ratio'] = r[m], r[m] / base[m]
                line += (f" | activation MB per rank: attention {r['attn_bytes'] / 2**20:.1f} (x{o['attn_bytes_ratio']:.3f}), "
                         f"whole forward {r['model_bytes'] / 2**20:.1f} (x{o['model_bytes_ratio']:.3f})")
            print(line)
    if a.json:
        tmp = a.json + '.tmp'
        with open(tmp, 'w') as f: json.dump(dict(args=vars(a), results=out), f, indent=1)
        os.replace(tmp, a.json)
    return out

if __name__ == '__main__':
    main()
