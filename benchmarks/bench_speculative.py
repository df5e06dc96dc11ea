"""Speculative (MTP drafts) over plain greedy decoding throughput, at batch 1 and batch 8, measured in one run.

    python benchmarks/bench_speculative.py                       # data/mtp/ckpt if present, else a synthetic toy model
    python benchmarks/bench_speculative.py --ckpt data/mtp/ckpt --stream data/tokens/heldout.bin --draft-len 1

Every figure is printed as a ratio to plain `composer2.decoding.generate` measured in the same process, on the same
prompts; the greedy outputs are checked to be identical.
"""
import argparse, json, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch

from composer2.model import ModelConfig, Transformer
from composer2.mtp import MTPHeads, MTPTrainConfig, load_mtp, train_mtp
from composer2.speculative import decode_comparison
from composer2.train import TrainConfig, WindowSampler, train


def toy(seed=0):
    "A small model and self-distilled heads on a repetitive synthetic stream (high acceptance), trained in ~20 s."
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 512, 23)[np.arange(50000) % 23]
    flip = rng.random(len(s)) < 0.03; s[flip] = rng.integers(0, 512, int(flip.sum()))
    s = s.astype(np.uint16)
    cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=512, n_experts=8,
                      top_k=2, d_expert=256)
    torch.manual_seed(seed)
    m = Transformer(cfg)
    with tempfile.TemporaryDirectory() as d:
        train(m, TrainConfig(steps=80, batch_size=8, seq_len=64, warmup_steps=5, lr=5e-3, log_every=1000), WindowSampler(s, 64, 8), d)
    m.eval()
    h = MTPHeads(cfg, depth=3)
    train_mtp(m, h, WindowSampler(s, 64, 8, seed=1), MTPTrainConfig(steps=80, seq_len=64, warmup_steps=5, lr=5e-3))
    return m, h, s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ckpt', default='data/mtp/ckpt', help='a save_mtp checkpoint (falls back to a toy model)')
    ap.add_argument('--stream', default='data/tokens/heldout.bin', help='uint16 token stream for the prompts')
    ap.add_argument('--draft-len', type=int, default=0, help='drafts per verify step (0: every length 1..D)')
    ap.add_argument('--prompt-len', type=int, default=32)
    ap.add_argument('--new-tokens', type=int, default=64)
    ap.add_argument('--batches', default='1,8')
    ap.add_argument('--reps', type=int, default=3)
    ap.add_argument('--threads', type=int, default=0)
    ap.add_argument('--toy', action='store_true', help='use the synthetic toy model even if the checkpoint exists')
    ap.add_argument('--json', default='', help='also write the results here')
    a = ap.parse_args(argv)
    if a.threads: torch.set_num_threads(a.threads)
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
    if not a.toy and (Path(a.ckpt) / 'meta.json').exists():
        m, h, _ = load_mtp(a.ckpt, dev); src = a.ckpt
        stream = np.memmap(a.stream, dtype=np.uint16, mode='r')
    else:
        m, h, stream = toy(); m, h = m.to(dev), h.to(dev); src = 'toy (synthetic repetitive stream)'
        stream = stream[-5000:]
    Ks = [a.draft_len] if a.draft_len else list(range(1, h.depth + 1))
    rng = np.random.default_rng(0)
    batches = [int(b) for b in a.batches.split(',')]
    offs = rng.integers(0, len(stream) - a.prompt_len, size=max(batches))
    prompts = [np.asarray(stream[o:o + a.prompt_len], dtype=np.int64).tolist() for o in offs]
    print(f"model: {src}; device {dev}, threads {torch.get_num_threads()}; MTP depth {h.depth}, draft lengths {Ks}, "
          f"prompt {a.prompt_len}, new tokens {a.new_tokens}, best of {a.reps}")
    res = {}
    for K, b in [(K, b) for K in Ks for b in batches]:
        r = decode_comparison(m, h, prompts[:b], a.new_tokens, K, a.reps)
        res[f'draft_{K}/batch_{b}'] = r
        print(f"draft_len {K}, batch {b}: plain {r['plain_tokens_per_s']:.1f} tok/s (1.00x)  speculative {r['spec_tokens_per_s']:.1f} tok/s "
              f"({r['speedup']:.2f}x)  tokens/verify {r['tokens_per_verify']:.2f}  acceptance/depth "
              f"{[round(x, 3) for x in r['acceptance_per_depth']]}  greedy identical: {r['greedy_match']}")
    if a.json: Path(a.json).write_text(json.dumps(res, indent=2))
    return 0 if all(r['greedy_match'] for r in res.values()) else 1


if __name__ == '__main__':
    sys.exit(main())
