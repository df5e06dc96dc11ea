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

`--mesh NAME...` instead measures the training step of `composer2.train` on the device mesh (`composer2.mesh`: FSDP2,
torch TP, EP all-to-all, ring attention), one configuration per name (`dp2`, `ep2`, `tp2`, `cp2`, `dp2xep2`, ...;
degrees multiply to the process count): tokens/s of the whole step (global batch / the slowest rank's median step time)
and memory per rank (parameters + gradients + AdamW state as stored on the rank, the activations autograd saves, peak
RSS), each as a ratio to the single-process trainer on the same global batch measured in the same run:

    .venv/bin/python benchmarks/bench_parallel.py --mesh dp2 ep2 tp2 cp2 dp4 dp2xep2 dp2xtp2 cp2xep2 --seq 256
    .venv/bin/torchrun --nproc_per_node 4 benchmarks/bench_parallel.py --mesh dp2xep2 --seq 256   # in a launched group
"""
import argparse, json, math, os, statistics, sys, time

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

def _local(t): return t.to_local() if hasattr(t, 'to_local') else t        # a DTensor's shard on this rank

def _activation_bytes(fn, params=()):
    """Bytes of the tensors autograd saves while running `fn()`, not counting those sharing storage with `params`
    (a list, or a callable giving it after `fn` ran: FSDP's gathered weights exist only then)."""
    seen = {}
    def pack(t):
        t_ = _local(t); seen[t_.untyped_storage().data_ptr()] = seen.get(t_.untyped_storage().data_ptr(), 0) + t_.numel() * t_.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    own = {_local(p).untyped_storage().data_ptr() for p in (params() if callable(params) else params)}
    return sum(v for k, v in seen.items() if k not in own)

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

def _parse(name: str) -> dict:
    "'dp2xep2' -> {'dp': 2, 'ep': 2}; '1' -> {}."
    import re
    if name == '1': return {}
    out = {}
    for part in name.split('x'):
        m = re.fullmatch(r'(dp|ep|tp|cp)(\d+)', part)
        if not m: raise SystemExit(f"bad mesh name {name!r}: use e.g. dp2, ep2xdp2, cp2xtp2")
        out[m[1]] = int(m[2])
    return out

def _state_bytes(model, opt):
    "Bytes this rank stores for parameters, gradients and optimizer state (local shards of DTensors)."
    from torch.distributed.tensor import DTensor
    loc = lambda t: t.to_local() if isinstance(t, DTensor) else t
    n = sum(loc(p).numel() * loc(p).element_size() * (2 if p.grad is not None else 1) for p in model.parameters())
    return n + sum(loc(v).numel() * loc(v).element_size() for st in opt.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.dim() > 0)

def mesh_rank(rank, world, a, name):
    "One rank of the `name` mesh (or the single-process trainer for '1'): step time and memory."
    import resource
    from composer2.mesh import MeshModel, ParallelConfig
    from composer2.train import TrainConfig, WindowSampler, _mesh_step, _step, make_optimizer
    import numpy as np
    par = ParallelConfig(**_parse(name)); dev = torch.device(f'cuda:{rank}' if torch.cuda.is_available() else 'cpu')
    cfg = _cfg(a); cfg.aux_loss_coef = 0.01
    tc = TrainConfig(steps=10, batch_size=a.batch * 4, seq_len=a.seq, warmup_steps=0, parallel=par)
    torch.manual_seed(0); model = Transformer(cfg).to(dev)
    stream = np.random.default_rng(0).integers(0, 4096, 200_000).astype(np.uint16)
    sampler = WindowSampler(stream, a.seq, tc.batch_size)
    if name == '1':
        mm, dw, dr = None, 1, 0
        opt, sched = make_optimizer(model, tc)
        step = lambda s: _step(model, None, opt, sched, sampler(s).to(dev), tc, dev, 1, 1, 0.01, None)
    else:
        mm = MeshModel(model, par.dims(), dev); dw, dr = par.dp * par.ep, mm.coords['dp']
        opt, sched = make_optimizer(mm, tc)
        step = lambda s: _mesh_step(mm, opt, sched, sampler(s, dr, dw).to(dev), tc, dev, 1, 0.01, None)
    it = iter(range(10 ** 6))
    t = _timed(lambda: step(next(it)), a.steps)
    target = mm.module if mm is not None else model
    state = _state_bytes(target, opt)                            # before the forward below gathers FSDP's weights
    b = sampler(0, dr, dw).to(dev)
    def fwd():
        if mm is None: return model(b.x).logits.sum()
        (x,) = mm.shard(b.x); return mm(x).logits.sum()
    act = _activation_bytes(fwd, lambda: list(target.parameters()))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gpu = torch.cuda.max_memory_allocated(dev) if dev.type == 'cuda' else 0
    return dict(seconds=t, state_bytes=state, act_bytes=act, rss_bytes=rss, gpu_bytes=gpu,
                tokens=tc.batch_size * a.seq)

def run_mesh(a):
    names = ['1'] + [n for n in a.mesh if n != '1']
    print(f"cores: {os.cpu_count()} (every rank uses 1 intra-op thread: with more ranks than free cores the times "
          f"measure contention, not speed-up) | global batch {a.batch * 4} x seq {a.seq}, d_model {a.d_model}, "
          f"{a.layers} layers, 8 experts top-2 + aux loss, median of {a.steps} steps")
    res, out = {}, {}
    for n in names:
        p = _parse(n); W = max(1, math.prod(p.values()))
        rs = spawn_local(mesh_rank, W, a, n)
        res[n] = dict(seconds=max(r['seconds'] for r in rs), tokens=rs[0]['tokens'], W=W,
                      **{k: max(r[k] for r in rs) for k in ('state_bytes', 'act_bytes', 'rss_bytes', 'gpu_bytes')})
    base = res['1']
    for n in names:
        r = res[n]; tps = r['tokens'] / r['seconds']
        o = out[n] = dict(ranks=r['W'], tokens_per_s=tps, tokens_per_s_ratio=tps * base['seconds'] / base['tokens'],
                          **{k: r[k] for k in ('state_bytes', 'act_bytes', 'rss_bytes')},
                          **{k + '_ratio': r[k] / max(1, base[k]) for k in ('state_bytes', 'act_bytes')})
        print(f"{n:>8} ({r['W']} ranks): {tps:8.0f} tok/s (x{o['tokens_per_s_ratio']:.2f}) | per rank: state "
              f"{r['state_bytes'] / 2**20:6.2f} MB (x{o['state_bytes_ratio']:.3f}), activations {r['act_bytes'] / 2**20:6.2f} MB "
              f"(x{o['act_bytes_ratio']:.3f}), peak RSS {r['rss_bytes'] / 2**20:5.0f} MB")
    return out

def launched(a):
    "Run under torchrun/deepspeed: self-check and a CP step over the launched world; rank 0 prints."
    import torch.distributed as dist
    cuda = torch.cuda.is_available()
    if cuda: torch.cuda.set_device(int(os.environ.get('LOCAL_RANK', 0)))
    dist.init_process_group('nccl' if cuda else 'gloo')
    torch.set_num_threads(1)
    r, W = dist.get_rank(), dist.get_world_size()
    if a.mesh:                                                   # one mesh configuration over the launched world
        m = mesh_rank(r, W, a, a.mesh[0]); res = [None] * W; dist.all_gather_object(res, m)
        if r == 0:
            print(f"launched world {W}, mesh {a.mesh[0]}: {m['tokens'] / max(x['seconds'] for x in res):.0f} tok/s; per rank: "
                  + ', '.join(f"state {x['state_bytes'] / 2**20:.1f} MB act {x['act_bytes'] / 2**20:.1f} MB gpu {x['gpu_bytes'] / 2**20:.1f} MB" for x in res))
        dist.destroy_process_group(); return
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
    ap.add_argument('--mesh', nargs='*', default=[], help='mesh configurations to train on (dp2, ep2, tp2, cp2, dp2xep2, ...)')
    ap.add_argument('--local_rank', type=int, default=0, help='set by the deepspeed launcher (LOCAL_RANK is used)')
    a = ap.parse_args(argv)
    if 'RANK' in os.environ and 'WORLD_SIZE' in os.environ: return launched(a)
    if a.mesh:
        out = run_mesh(a)
        if a.json:
            with open(a.json + '.tmp', 'w') as f: json.dump(dict(args=vars(a), results=out), f, indent=1)
            os.replace(a.json + '.tmp', a.json)
        return out
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
