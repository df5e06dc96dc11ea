"""Continuous batching in `composer2.serve.Engine`: N requests submitted together (they share decode steps) against the
same N one after another, and against one static `composer2.decoding.generate` batch of the N prompts (the engine's
floor), measured in one run (best of repeats), greedy, every request decoding exactly `--new` tokens.

    python benchmarks/bench_serve.py [--n 8] [--prompt 48] [--new 64] [--reps 3] [--threads 2]

Prints tokens/s of each and the ratios concurrent/sequential (the gain of sharing decode steps) and concurrent/generate
(the engine's cost over a static batch: per-request admission, cache merges and per-token text)."""
import argparse, sys, threading
import torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2.model import ModelConfig, Transformer
from composer2.decoding import generate
from composer2.rl_rollout import tiny_tokenizer
from composer2.serve import Engine, _Seq


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--n', type=int, default=8); ap.add_argument('--prompt', type=int, default=48)
    ap.add_argument('--new', type=int, default=64); ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--threads', type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads); torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, n_experts=8,
                                    top_k=2, d_expert=256, max_seq_len=512)).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(30, tok.vocab_size, (a.prompt - i % 5,), generator=g).tolist() for i in range(a.n)]
    eng = Engine(model, tok)

    def run(ps):
        evs = [threading.Event() for _ in ps]
        for p, ev in zip(ps, evs):
            eng.submit(_Seq(p, a.new, 0.0, 1.0, None, [], True, lambda e, ev=ev: ev.set() if e[0] in ('done', 'error') else None))
        for ev in evs: ev.wait()

    t_conc = best_time(lambda: run(prompts), a.reps)
    t_seq = best_time(lambda: [run([p]) for p in prompts], a.reps)
    t_gen = best_time(lambda: generate(model, prompts, max_new_tokens=a.new, temperature=0.0), a.reps)
    tok_n = a.n * a.new
    print(f"{a.n} requests x {a.new} tokens, prompts ~{a.prompt}, {a.threads} threads, best of {a.reps}")
    print(f"engine, concurrent : {tok_n / t_conc:8.0f} tok/s  (max batch {eng.stats['max_batch']})")
    print(f"engine, sequential : {tok_n / t_seq:8.0f} tok/s")
    print(f"generate, static   : {tok_n / t_gen:8.0f} tok/s")
    print(f"concurrent/sequential = {t_seq / t_conc:.2f}x   concurrent/generate = {t_gen / t_conc:.2f}x")
    eng.close()


if __name__ == '__main__':
    main()
