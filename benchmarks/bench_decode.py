"""Greedy KV-cached decoding (`composer2.decoding.generate`) against HF transformers' `generate` on a same-shaped
Qwen2MoeForCausalLM holding the SAME weights, measured in one run (best of repeats), 2 threads.

    python benchmarks/bench_decode.py [--batches 1,32] [--prompt 64] [--new 64] [--reps 5] [--threads 2] [--no-compile]

The HF model comes from `composer2.hf.export_hf` (Qwen2-MoE; the shared expert with a zero `shared_expert_gate`,
sigmoid(0) = 1/2, and its down projection doubled). Prints max |dlogit|
of a full forward, the fraction of greedy tokens that agree, tokens/s of both and the ratio ours/HF, for our eager steps
and for our compiled ones (`generate(compile=True)`: one graph per batch size, compiled before timing; the compile time is
printed apart). HF runs its default eager `generate`, as a user would call it. Each arm is also timed generating one token
(the prefill and the first token), so the ratio splits into the prefill's and the later steps'."""
import argparse, sys, time
import torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2.config import load_section, repo_root
from composer2.model import ModelConfig, Transformer
from composer2.decoding import generate


def to_hf(m):
    "A transformers model holding the weights of our Transformer `m`, through `composer2.hf.export_hf` (the one mapping)."
    import tempfile
    from transformers import AutoModelForCausalLM
    from composer2.hf import export_hf
    with tempfile.TemporaryDirectory() as d:
        export_hf(m, d)
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--batches', default='1,32'); ap.add_argument('--prompt', type=int, default=64)
    ap.add_argument('--new', type=int, default=64); ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--warmup', type=int, default=1)
    ap.add_argument('--no-compile', action='store_true', help='skip the compiled-steps arm')
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads); torch.manual_seed(0)
    cfg = load_section(ModelConfig, 'model', repo_root() / 'params.yaml'); cfg.max_seq_len = 1024
    m = Transformer(cfg).eval()
    hf = to_hf(m)
    ids = torch.randint(0, cfg.vocab_size, (4, 96))
    with torch.no_grad():
        dl = (m(ids).logits - hf(ids).logits).abs().max().item()
    print(f"model {cfg.d_model}d x {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, vocab {cfg.vocab_size}; "
          f"threads {torch.get_num_threads()}; prompt {a.prompt}, {a.new} new tokens, best of {a.reps}")
    print(f"logits agreement (full forward, 4x96 tokens): max |dlogit| = {dl:.2e}")
    for B in [int(b) for b in a.batches.split(',')]:
        P, N = a.prompt, a.new
        prompts = torch.randint(0, cfg.vocab_size, (B, P))
        ours = lambda n=N: generate(m, prompts.tolist(), max_new_tokens=n)
        comp = lambda n=N: generate(m, prompts.tolist(), max_new_tokens=n, compile=True)
        @torch.inference_mode()
        def theirs(n=N):
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
        to, th = ours().tokens, theirs()[:, P:].tolist()
        arms = [('eager', ours)]
        if not a.no_compile:
            t0 = time.perf_counter(); tc = comp().tokens; tcomp = time.perf_counter() - t0
            arms.append(('compiled', comp))
        for _ in range(a.warmup): [f() for _, f in arms]; theirs()
        agree = sum(x == y for r, s in zip(to, th) for x, y in zip(r, s)) / (B * N)
        first = sum(r[:1] == s[:1] for r, s in zip(to, th)) / B
        wall = {n: [] for n, _ in arms + [('HF', theirs)]}; cpu = {n: [] for n in wall}; first_tok = {n: [] for n in wall}
        for _ in range(a.reps):      # interleaved, so that machine noise hits all arms alike
            for n, f in arms + [('HF', theirs)]:
                t0, c0 = time.perf_counter(), time.process_time(); f()
                wall[n].append(time.perf_counter() - t0); cpu[n].append(time.process_time() - c0)
                t0 = time.perf_counter(); f(1); first_tok[n].append(time.perf_counter() - t0)   # the prefill and one token
        best = {n: min(w) for n, w in wall.items()}; med = {n: sorted(w)[len(w) // 2] for n, w in wall.items()}
        print(f"batch {B}: " + ', '.join(f"{n} {B*N/best[n]:,.0f} tok/s (median {B*N/med[n]:,.0f})" for n in wall)
              + f"; eager greedy tokens equal HF's {agree:.1%} (first token {first:.0%})")
        if not a.no_compile:
            same = sum(x == y for r, s in zip(to, tc) for x, y in zip(r, s)) / (B * N)
            print(f"  compiled: first call {tcomp:.1f} s (compile + one run); greedy tokens equal eager's {same:.1%}")
        pre = {n: min(w) for n, w in first_tok.items()}; step = {n: (best[n] - pre[n]) / max(1, N - 1) for n in wall}
        print("  where the time goes (best of each): " + ', '.join(f"{n} prefill + first token {pre[n] * 1e3:.1f} ms, "
                                                              f"then {step[n] * 1e3:.2f} ms a step" for n in wall))
        for n, _ in arms:
            print(f"RATIO ours {n}/HF batch {B} = {best['HF'] / best[n]:.2f}x wall best (medians {med['HF'] / med[n]:.2f}x; "
                  f"process CPU time best {min(cpu['HF']) / min(cpu[n]):.2f}x; prefill {pre['HF'] / pre[n]:.2f}x, "
                  f"later steps {step['HF'] / step[n]:.2f}x)")


if __name__ == '__main__':
    main()
