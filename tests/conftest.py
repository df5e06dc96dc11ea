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
