"""Asynchronous RL against the synchronous baseline (generate a batch, then train on it), same model, same toy
environment, same run: samples/s, the trainer's idle fraction, rollout tokens/s.
`python benchmarks/bench_rl.py [--steps N] [--workers W] [--latency S] [--dmodel D]`.
The environment is `ToyEnv` with a fixed per-tool-call latency (a stand-in for the sandbox), so the figures measure
the RL machinery, not the harness."""
import argparse, sys, tempfile, time
import torch
import composer2.rl as R

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--steps', type=int, default=6)
    ap.add_argument('--workers', type=int, default=1)
    ap.add_argument('--latency', type=float, default=0.02)
    ap.add_argument('--dmodel', type=int, default=128)
    ap.add_argument('--threads', type=int, default=1)
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    tok, codec, _ = R.tiny_setup(seed=0)
    kw = dict(d_model=a.dmodel, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8, top_k=2, d_expert=2 * a.dmodel)
    rc = R.RolloutConfig(max_new_tokens=24, max_turns=3, context_budget=256, env_threads=4, dtype='bfloat16')
    jobs = {f'p{i:03d}': {'env': {'turns': 3, 'obs_words': 6, 'latency': a.latency}} for i in range(512)}
    res = {}
    for backend in ('sync', 'local'):
        cfg = R.RLConfig(n_train_tasks=512, steps=a.steps, groups_per_step=4, group_size=4, max_staleness=2, backend=backend,
                         n_workers=a.workers, groups_per_batch=4, worker_threads=a.threads, trainer_threads=a.threads,
                         ckpt_every=0, mismatch_every=0, env_backend='local', rollout=rc)
        model = R.tiny_setup(seed=0, **kw)[2]
        with tempfile.TemporaryDirectory() as d:
            h = R.run_rl(cfg, model, tok.hf.to_str(), jobs, R.toy_env_factory, d)
        t = h['throughput']; res[backend] = t
        stale = h['staleness']
        print(f"{backend:5s}: {t['samples_per_s']:.2f} samples/s, trainer idle {t['trainer_idle_frac']:.2f}, "
              f"rollout {t['rollout_tokens_per_s']:.0f} tok/s, wall {t['wall_s']:.1f}s, staleness histogram {stale}")
    print(f"RATIO async/sync samples/s = {res['local']['samples_per_s'] / res['sync']['samples_per_s']:.2f}x "
          f"(anchors: AReaL 2.77x, verl 2.35-2.67x; this machine: {torch.get_num_threads()} trainer thread(s), {a.workers} worker(s))")


if __name__ == '__main__':   # the local backend spawns worker processes that re-import this file
    main()
