"""Where a real rollout's time goes: the default run's agent-SFT checkpoint on `eval_rl`'s held-out tasks, in the
sandboxed harness, with `eval_rl`'s rollout settings. One batch of `--groups` tasks x `--k` samples; every figure is
a share of that batch's wall time, measured in the same run:
- decode steps (`TokenPolicy.advance`: the model forward, sampling, cache bookkeeping), of which the model forward;
- everything else: the environments' tool calls (each round of `run_episodes` waits for all of them, so no decoding
  runs meanwhile), resets, grading and the episode loop.
Then the decode forward at batch 32 / 64 / 128 (one token per row, 400 tokens of context), per row against batch
128: what splitting the batch into cohorts (decode one while the other's tools run) would cost.
Needs the default pipeline's outputs (`dvc repro agent_sft`); skipped without them. `python benchmarks/bench_rollout.py [--groups 8] [--k 16]`."""
import argparse, dataclasses, sys, time
from pathlib import Path
import torch

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--groups', type=int, default=8)
    ap.add_argument('--k', type=int, default=16)
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--dtype', default=None, help='rollout weights (default: eval_rl.rollout.dtype)')
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    from composer2.config import load_section, to_dict
    from composer2.rl_eval import EvalRLConfig, heldout_jobs
    cfg = load_section(EvalRLConfig, 'eval_rl', root / 'params.yaml')
    for p in (cfg.sft_ckpt, cfg.tokenizer):
        if not (root / p).exists():     # like the GPU figures without CUDA: skipped, so `make bench` goes on
            print(f'bench_rollout: skipped: {root / p} is missing (run `dvc repro agent_sft` first)'); return
    import composer2.rl_rollout as RR
    from composer2.rl_transport import WorkerSpec, build_rollout_model, rollout_groups
    from composer2.tokenizer import Tokenizer
    from composer2.train import load_model
    torch.set_num_threads(a.threads)
    tok = Tokenizer.load(root / cfg.tokenizer)
    jobs, _, fac = heldout_jobs(cfg, root)
    jobs = [dict(j, group_size=a.k) for j in jobs[:a.groups]]
    model, _ = load_model(root / cfg.sft_ckpt)
    rc = dataclasses.replace(cfg.rollout, dtype=a.dtype or cfg.rollout.dtype)
    spec = WorkerSpec(to_dict(model.cfg), tok.hf.to_str(), rc, fac, len(jobs), 1, 0)
    rmodel, codec = build_rollout_model(spec); RR.load_state_into(rmodel, RR.publishable_state(model))

    T = {'advance': 0.0, 'forward': 0.0}
    def timed(key, f):
        def g(*args, **kw):
            t = time.perf_counter(); out = f(*args, **kw); T[key] += time.perf_counter() - t; return out
        return g
    adv, fwd = RR.TokenPolicy.advance, rmodel.forward
    RR.TokenPolicy.advance = timed('advance', adv)
    rmodel.forward = timed('forward', fwd)
    try:
        t0 = time.perf_counter()
        res, _, _ = rollout_groups(rmodel, codec, spec, jobs, None, 0, RR.episode_generators(jobs, 0))
        wall = time.perf_counter() - t0
    finally:
        RR.TokenPolicy.advance = adv; rmodel.forward = fwd
    ngen = sum(t.gen_tokens for _, ts in res for t in ts)
    print(f'rollout of {a.groups} tasks x {a.k} samples, {rc.dtype}, {a.threads} thread(s): wall {wall:.1f} s, '
          f'{ngen} generated tokens ({ngen / wall:.0f}/s)')
    print(f'RATIO decode steps / wall = {T["advance"] / wall:.2f}  (model forward {T["forward"] / wall:.2f})')
    print(f'RATIO tool calls, resets, grading and loop / wall = {(wall - T["advance"]) / wall:.2f}')

    from composer2.decoding import KVCache
    per_row = {}
    with torch.no_grad():
        for B in (32, 64, 128):
            ids = torch.randint(0, rmodel.cfg.vocab_size, (B, 400), generator=torch.Generator().manual_seed(0))
            cache = KVCache.for_model(rmodel, B, 960); rmodel(ids, cache=cache)
            one = ids[:, -1:]
            ts = []
            for _ in range(9):
                cache.truncate(torch.full((B,), 400)); t = time.perf_counter(); rmodel(one, cache=cache)
                ts.append(time.perf_counter() - t)
            per_row[B] = sorted(ts)[len(ts) // 2] / B
    for B in (32, 64):
        print(f'RATIO decode forward per row, batch {B} / batch 128 = {per_row[B] / per_row[128]:.2f}')

if __name__ == '__main__': main()
