"""Greedy KV-cached decoding (`composer2.decoding.generate`) against HF transformers' `generate` on a same-shaped
Qwen2MoeForCausalLM holding the SAME weights, measured in one run (best of repeats), 2 threads.

    python benchmarks/bench_decode.py [--batches 1,32] [--prompt 64] [--new 64] [--reps 5] [--threads 2]

The mapping: q/k/v/o -> q/k/v/o_proj (qkv_bias off), router -> gate, w1|w3 -> experts.gate_up_proj, w2 -> down_proj,
the shared expert with a zero `shared_expert_gate` (sigmoid(0) = 1/2) and its down projection doubled. Prints max |dlogit|
of a full forward, the fraction of greedy tokens that agree, tokens/s of both and the ratio ours/HF."""
import argparse, sys, time
import torch
sys.path.insert(0, __file__.rsplit('/', 1)[0])
from _common import best_time
from composer2.config import load_section, repo_root
from composer2.model import ModelConfig, Transformer
from composer2.decoding import generate


def to_hf(m):
    "A Qwen2MoeForCausalLM with the weights of our Transformer `m` (softmax router, no dense layers)."
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    c = m.cfg
    assert c.router == 'softmax' and c.n_dense_layers == 0 and c.rope_scaling.kind == 'none'
    hc = Qwen2MoeConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, num_hidden_layers=c.n_layers,
                        num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads, max_position_embeddings=c.max_seq_len,
                        rope_theta=c.rope_theta, num_experts=c.n_experts, num_experts_per_tok=c.top_k,
                        moe_intermediate_size=c.d_expert, shared_expert_intermediate_size=c.d_expert * c.n_shared_experts,
                        norm_topk_prob=c.norm_topk, rms_norm_eps=c.norm_eps, tie_word_embeddings=c.tie_embeddings,
                        qkv_bias=False, output_router_logits=False, decoder_sparse_step=1, intermediate_size=c.d_dense,
                        use_sliding_window=False, head_dim=c.head_dim)
    hc.rope_parameters = {'rope_type': 'default', 'rope_theta': c.rope_theta}
    hf = Qwen2MoeForCausalLM(hc).eval()
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(m.embed.weight); hf.model.norm.weight.copy_(m.norm.weight)
        if not c.tie_embeddings: hf.lm_head.weight.copy_(m.head.weight)
        for L, H in zip(m.layers, hf.model.layers):
            a, ha = L.attn, H.self_attn
            for s, d in [(a.wq, ha.q_proj), (a.wk, ha.k_proj), (a.wv, ha.v_proj), (a.wo, ha.o_proj)]: d.weight.copy_(s.weight)
            H.input_layernorm.weight.copy_(L.attn_norm.weight); H.post_attention_layernorm.weight.copy_(L.ffn_norm.weight)
            f, hm = L.ffn, H.mlp
            hm.gate.weight.copy_(f.router.weight)
            hm.experts.gate_up_proj.copy_(torch.cat([f.w1, f.w3], 1)); hm.experts.down_proj.copy_(f.w2)
            if f.shared is not None:
                hm.shared_expert.gate_proj.weight.copy_(f.shared.w1.weight); hm.shared_expert.up_proj.weight.copy_(f.shared.w3.weight)
                hm.shared_expert.down_proj.weight.copy_(2 * f.shared.w2.weight); hm.shared_expert_gate.weight.zero_()
            else:
                hm.shared_expert.down_proj.weight.zero_()
    return hf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--batches', default='1,32'); ap.add_argument('--prompt', type=int, default=64)
    ap.add_argument('--new', type=int, default=64); ap.add_argument('--reps', type=int, default=5)
    ap.add_argument('--threads', type=int, default=2)
    ap.add_argument('--warmup', type=int, default=1)
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
        ours = lambda: generate(m, prompts.tolist(), max_new_tokens=N)
        @torch.inference_mode()
        def theirs():
            return hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=N, min_new_tokens=N,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
        to, th = ours().tokens, theirs()[:, P:].tolist()
        for _ in range(a.warmup): ours(); theirs()
        agree = sum(x == y for r, s in zip(to, th) for x, y in zip(r, s)) / (B * N)
        first = sum(r[:1] == s[:1] for r, s in zip(to, th)) / B
        tt, tu, ct, cu = [], [], [], []
        for _ in range(a.reps):      # interleaved, so that machine noise hits both alike
            for f, w, c in [(ours, tt, ct), (theirs, tu, cu)]:
                t0, c0 = time.perf_counter(), time.process_time(); f()
                w.append(time.perf_counter() - t0); c.append(time.process_time() - c0)
        bo, bh = min(tt), min(tu)
        mo, mh = sorted(tt)[len(tt) // 2], sorted(tu)[len(tu) // 2]
        print(f"batch {B}: ours {B*N/bo:,.0f} tok/s (median {B*N/mo:,.0f}), HF {B*N/bh:,.0f} tok/s (median {B*N/mh:,.0f}); "
              f"greedy tokens equal {agree:.1%} (first token {first:.0%})")
        print(f"RATIO ours/HF batch {B} = {bh / bo:.2f}x wall best (medians {mh / mo:.2f}x; process CPU time best {min(cu) / min(ct):.2f}x)")


if __name__ == '__main__':
    main()
