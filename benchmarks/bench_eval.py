"""`eval_rl`'s scoring arrangement: its two checkpoints (agent SFT and RL) side by side in two one-thread processes
(`eval_checkpoints(..., processes=2)`, the stage's default) against one after another in this process with two threads
(`processes=1`, what the stage did before), on the same held-out tasks with the same per-episode noise, same run.
Prints the wall-time ratio and checks both arrangements produced the same rewards. Needs the default pipeline's
outputs (`dvc repro eval_rl`); skipped without them. `python benchmarks/bench_eval.py [--tasks 8] [--k 16]`."""
import argparse, dataclasses, time
from pathlib import Path

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--tasks', type=int, default=8); ap.add_argument('--k', type=int, default=16)
    a = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    from composer2.config import load_section
    from composer2.rl_eval import EvalRLConfig, heldout_jobs, eval_checkpoints
    from composer2.tokenizer import stage_tokenizer
    cfg = load_section(EvalRLConfig, 'eval_rl', root / 'params.yaml')
    for p in (cfg.sft_ckpt, cfg.rl_ckpt, cfg.tokenizer):
        if not (root / p).exists():
            print(f'bench_eval: skipped: {root / p} is missing (run `dvc repro eval_rl` first)'); return
    tok = stage_tokenizer(root / cfg.tokenizer, root / cfg.sft_ckpt)
    jobs, _, fac = heldout_jobs(cfg, root)
    jobs = [dict(j, group_size=a.k) for j in jobs[:a.tasks]]
    ckpts = {'agent_sft': root / cfg.sft_ckpt, 'rl': root / cfg.rl_ckpt}
    wall, res = {}, {}
    for P in (1, 2, 1, 2):            # interleaved: the machine's speed drifts
        t = time.perf_counter()
        r = eval_checkpoints(ckpts, tok, jobs, fac, cfg.rollout, cfg.groups_per_batch, cfg.seed, 2, True, processes=P)
        wall.setdefault(P, []).append(time.perf_counter() - t)
        res.setdefault(P, []).append({n: [t.reward for _, ts in v for t in ts] for n, v in r.items()})
    w1, w2 = min(wall[1]), min(wall[2])
    same = all(x == res[1][0] for x in res[1] + res[2])        # exact: every reward of every checkpoint
    print(f'{len(jobs)} tasks x {a.k} samples x 2 checkpoints: one process, 2 threads {w1:.1f} s; two processes, 1 thread '
          f'each {w2:.1f} s (best of 2 each); identical rewards in all four runs: {same}')
    print(f'RATIO two processes / one process (speed) = {w1 / w2:.2f}')

if __name__ == '__main__': main()
