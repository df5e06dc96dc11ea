"""MTP heads: architecture, losses against independent references, both trainings, checkpoints, the `mtp` stage."""
import json, tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from composer2.config import ConfigError
from composer2.model import ModelConfig, Transformer
from composer2.mtp import (MTPHeads, MTPStageConfig, MTPTrainConfig, acceptance_stats, load_mtp, mtp_ce, mtp_kl, save_mtp,
                           train_mtp)
from composer2.stages.mtp import run as stage
from composer2.train import CheckpointError, TrainConfig, WindowSampler, load_model, save_checkpoint, train
import functools
from conftest import cycle_stream as _cycle, mtp_cfg as tiny_cfg
cycle_stream = functools.partial(_cycle, noise=0.05)       # a little noise: the MTP targets are not deterministic


@pytest.fixture(scope='module')
def trained_main():
    torch.manual_seed(0)
    m = Transformer(tiny_cfg())
    with tempfile.TemporaryDirectory() as d:
        train(m, TrainConfig(steps=50, batch_size=8, seq_len=32, warmup_steps=3, lr=1e-2, log_every=1000), WindowSampler(cycle_stream(), 32, 8), d)
    return m.eval()


def manual_mtp(m, h, ids):
    "An independent, loop-over-positions reference of the MTP chain (full recompute per position, no batching tricks)."
    B, T = ids.shape
    h0 = m(ids, return_hidden=True).hidden
    outs, prev = [], h0
    for k in range(1, h.depth + 1):
        mod = h.mods[k - 1]
        n = T - k
        x = mod.proj(torch.cat([mod.emb_norm(m.embed(ids[:, k:k + n])), mod.hid_norm(prev[:, :n])], -1))
        pos = torch.arange(n)[None].expand(B, n)
        y, _ = mod.block(x, pos, m.inv_freq, m.mscale)
        outs.append(m.head(mod.norm(y))); prev = y
    return outs


@pytest.mark.parametrize('moe', [False, True])
def test_heads_shapes_sharing_and_reference(moe):
    torch.manual_seed(0)
    m = Transformer(tiny_cfg()).eval(); h = MTPHeads(m.cfg, depth=3, moe=moe).eval()
    ids = torch.randint(0, 64, (3, 10))
    with torch.no_grad():
        lg, aux = h(m, ids, m(ids, return_hidden=True).hidden)
        ref = manual_mtp(m, h, ids)
    assert [tuple(x.shape) for x in lg] == [(3, 9, 64), (3, 8, 64), (3, 7, 64)]
    for a, b in zip(lg, ref): assert torch.allclose(a, b, atol=1e-5)
    names = [n for n, _ in h.named_parameters()]
    assert not any('embed' in n or n.startswith('head') for n in names)
    assert all(p.data_ptr() != m.embed.weight.data_ptr() for p in h.parameters())
    assert (float(aux) > 0) == moe
    # causality: depth k at index i may only see tokens <= i + k
    ids2 = ids.clone(); ids2[:, 6] = (ids2[:, 6] + 1) % 64
    with torch.no_grad(): lg2, _ = h(m, ids2, m(ids2, return_hidden=True).hidden)
    for k, (a, b) in enumerate(zip(lg, lg2), start=1):
        assert torch.allclose(a[:, :6 - k], b[:, :6 - k], atol=1e-5)
        assert not torch.allclose(a[:, 6 - k], b[:, 6 - k], atol=1e-5)


def test_losses_against_torch_references():
    torch.manual_seed(0)
    main = torch.randn(2, 8, 11); ys = torch.randint(0, 11, (2, 8))
    q = [torch.randn(2, 8 - k, 11) for k in (1, 2)]
    for k, (kl, l) in enumerate(zip(mtp_kl(q, main), q), start=1):
        ref = F.kl_div(l.log_softmax(-1).reshape(-1, 11), main[:, k:].log_softmax(-1).reshape(-1, 11), log_target=True, reduction='sum') / l.shape[0] / l.shape[1]
        assert torch.allclose(kl, ref, atol=1e-5)
    for k, (ce, l) in enumerate(zip(mtp_ce(q, ys), q), start=1):
        # depth k at index i predicts t_{i+k+1} = y[i+k]
        ref = np.mean([-float(l[b, i].log_softmax(-1)[ys[b, i + k]]) for b in range(2) for i in range(8 - k)])
        assert abs(float(ce) - ref) < 1e-5
    # the distillation target is detached: no gradient reaches the main logits
    main.requires_grad_(True); qq = [x.clone().requires_grad_(True) for x in q]
    sum(mtp_kl(qq, main)).backward()
    assert main.grad is None and all(x.grad is not None for x in qq)


def test_self_distill_freezes_main_and_learns(trained_main):
    m = trained_main
    before = {k: v.clone() for k, v in m.state_dict().items()}
    h = MTPHeads(m.cfg, depth=2)
    h0 = {k: v.clone() for k, v in h.state_dict().items()}
    hist = train_mtp(m, h, WindowSampler(cycle_stream(), 32, 8, seed=3), MTPTrainConfig(steps=40, seq_len=32, warmup_steps=2, lr=1e-2))
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert all(p.requires_grad for p in m.parameters())            # restored afterwards
    assert any(not torch.equal(h0[k], v) for k, v in h.state_dict().items())
    assert hist['mtp_loss'][-1] < 0.5 * hist['mtp_loss'][0]
    held = cycle_stream(seed=0)[-3000:]
    untrained = acceptance_stats(m, MTPHeads(m.cfg, depth=2), held, seq_len=32, n_windows=8)
    trained = acceptance_stats(m, h, held, seq_len=32, n_windows=8)
    assert trained['greedy'][0] > 0.9 and trained['one_minus_tv'][0] > untrained['one_minus_tv'][0] + 0.2


def test_joint_trains_main_and_heads(trained_main):
    import copy
    m = copy.deepcopy(trained_main)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    h = MTPHeads(m.cfg, depth=2)
    hist = train_mtp(m, h, WindowSampler(cycle_stream(), 32, 8, seed=3), MTPTrainConfig(steps=30, seq_len=32, warmup_steps=2, lr=1e-2), mode='joint')
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert hist['mtp_loss'][-1] < hist['mtp_loss'][0]
    with pytest.raises(ValueError, match='mode'): train_mtp(m, h, None, MTPTrainConfig(steps=1, warmup_steps=0), mode='bogus')


@pytest.mark.numerics
def test_acceptance_stats_matches_a_direct_count(trained_main):
    m = trained_main; h = MTPHeads(m.cfg, depth=2).eval()
    s = cycle_stream(seed=5)[:500]
    st = acceptance_stats(m, h, s, seq_len=20, n_windows=3, batch=2)
    offs = np.linspace(0, len(s) - 21, 3).astype(np.int64)
    hits, tv, n, ties = 0, 0.0, 0, 0
    with torch.no_grad():
        for o in offs:
            w = torch.tensor(s[o:o + 20].astype(np.int64))[None]
            out = m(w, return_hidden=True); lg, _ = h(m, w, out.hidden)
            for i in range(19):                        # depth 1, index i vs main at i + 1
                p, q = out.logits[0, i + 1], lg[0][0, i]
                hits += int(p.argmax() == q.argmax()); tv += float(torch.minimum(p.softmax(-1), q.softmax(-1)).sum()); n += 1
                ties += int(any(float(t[0] - t[1]) < 1e-4 for t in (p.topk(2).values, q.topk(2).values)))
    # acceptance_stats runs windows in batches of 2, this count one at a time: the logits differ in the last bits,
    # so a greedy hit may flip only at a near-tie of either argmax, and 1 - TV agrees to float tolerance
    assert abs(st['greedy'][0] - hits / n) <= ties / n + 1e-9 and abs(st['one_minus_tv'][0] - tv / n) < 1e-5


def test_checkpoint_roundtrip_and_errors(tmp_path, trained_main):
    m = trained_main; h = MTPHeads(m.cfg, depth=2)
    save_mtp(tmp_path / 'ckpt', m, h, {'stage': 'mtp'})
    m2, h2, meta = load_mtp(tmp_path / 'ckpt')
    assert meta['stage'] == 'mtp' and h2.depth == 2 and not h2.moe
    assert all(torch.equal(a, b) for a, b in zip(h.state_dict().values(), h2.state_dict().values()))
    m3, _ = load_model(tmp_path / 'ckpt')                 # the main model loads with the ordinary loader
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m3.state_dict().values()))
    save_checkpoint(tmp_path / 'plain', m)
    with pytest.raises(CheckpointError, match='no MTP heads'): load_mtp(tmp_path / 'plain')
    p = tmp_path / 'ckpt' / 'mtp.safetensors'; p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match='sha256'): load_mtp(tmp_path / 'ckpt')
    with pytest.raises(ValueError, match='d_model'): h(Transformer(tiny_cfg(d_model=64)), torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 5, 64))


def test_config_errors():
    from composer2.config import from_dict
    with pytest.raises(ConfigError, match='draft_len'): MTPStageConfig(depth=2, draft_len=3)
    with pytest.raises(ConfigError, match='warmup_steps'): MTPTrainConfig(steps=5, warmup_steps=5)
    with pytest.raises(ConfigError, match='unknown key'): from_dict(MTPStageConfig, {'detph': 2}, 'mtp')
    with pytest.raises(ConfigError, match='mtp.train.steps'): from_dict(MTPStageConfig, {'train': {'steps': 0}}, 'mtp')


def make_workspace(root: Path, steps=40):
    "A tiny pipeline workspace: a trained base checkpoint at data/long_context/ckpt and code streams."
    (root / 'data/tokens').mkdir(parents=True)
    cycle_stream(seed=0).tofile(root / 'data/tokens/code_train.bin')
    cycle_stream(n=4000, seed=0).tofile(root / 'data/tokens/heldout.bin')     # same cycle, different noise
    torch.manual_seed(0)
    m = Transformer(tiny_cfg())
    train(m, TrainConfig(steps=50, batch_size=8, seq_len=32, warmup_steps=3, lr=1e-2, log_every=1000),
          WindowSampler(cycle_stream(), 32, 8), root / 'data/long_context', stage='long_context')
    params = {'mtp': {'depth': 2, 'eval_seq_len': 32, 'eval_windows': 8, 'decode_prompts': 4, 'prompt_len': 8, 'new_tokens': 16,
                      'bench_reps': 1, 'train': {'steps': steps, 'batch_size': 8, 'seq_len': 32, 'lr': 0.01, 'warmup_steps': 2}}}
    (root / 'params.yaml').write_text(yaml.safe_dump(params))
    return root / 'params.yaml'


@pytest.mark.numerics      # greedy_match compares plain and speculative decoding (different shapes) token for token
def test_stage_end_to_end(tmp_path, monkeypatch):
    params = make_workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    met = stage(str(params))
    saved = json.loads((tmp_path / 'reports/metrics/mtp.json').read_text())
    assert saved['acceptance'] == met['acceptance']
    assert set(met['acceptance']) == {'untrained', 'joint', 'self_distill'}
    assert met['acceptance']['self_distill'] > met['acceptance']['untrained']
    assert met['one_minus_tv']['self_distill'][0] > met['one_minus_tv']['untrained'][0]
    assert met['greedy_match'] and met['speedup'] > 0 and len(met['acceptance_per_depth']['self_distill']) == 2
    assert met['decode']['self_distill']['tokens_per_verify'] >= 1
    m, h, meta = load_mtp(tmp_path / 'data/mtp/ckpt')
    assert meta['stage'] == 'mtp' and h.depth == 2
    assert (tmp_path / 'data/mtp/config.json').exists()
    assert list((tmp_path / 'reports/live/mtp').rglob('*.tsv'))


def test_stage_missing_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'params.yaml').write_text(yaml.safe_dump({'mtp': {'depth': 1, 'draft_len': 1}}))
    with pytest.raises(ConfigError, match='long_context'): stage('params.yaml')
    (tmp_path / 'params.yaml').write_text(yaml.safe_dump({'other': {}}))
    with pytest.raises(ConfigError, match="missing section 'mtp'"): stage('params.yaml')
