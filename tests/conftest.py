import os, sys
from pathlib import Path
import pytest, torch

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)
    yield

def tiny_cfg(**kw):
    from composer2.model import ModelConfig
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=16, max_seq_len=64)
    base.update(kw)
    return ModelConfig(**base)

def mtp_cfg(vocab=64, **kw):
    "The tiny MoE model of the MTP and speculative-decoding tests (2 layers, 4 experts, 256-token context)."
    from composer2.model import ModelConfig
    base = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, top_k=2, d_expert=32, max_seq_len=256)
    base.update(kw)
    return ModelConfig(**base)

def cycle_stream(n=20000, period=7, vocab=64, noise=0.0, seed=0):
    "A uint16 token stream repeating a random cycle of `period` tokens, with a fraction `noise` of random replacements."
    import numpy as np
    rng = np.random.default_rng(seed)
    s = rng.integers(0, vocab, period)[np.arange(n) % period]
    flip = rng.random(n) < noise
    s[flip] = rng.integers(0, vocab, int(flip.sum()))
    return s.astype(np.uint16)
