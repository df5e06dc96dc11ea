"""composer2.lowp: the NVFP4-forward / MXFP8-backward linear and grouped linear."""
import pytest
import torch
import torch.nn.functional as F

from composer2 import quant as Q
from composer2.lowp import (LowpConfig, grad_errors, grouped_linear, lowp_config, lowp_grouped_linear, lowp_linear,
                            train_mlp)

EXACT = LowpConfig(sr=False, rht=False)


def fq8(t, elem='e4m3', rule='rceil'):
    return Q.fake_quant_mxfp8(t.contiguous(), elem=elem, rule=rule)


def test_forward_is_linear_on_fake_quantised_operands():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 5, 40), torch.randn(24, 40), torch.randn(24)
    y = lowp_linear(x, w, b)
    xq = Q.fake_quant_nvfp4(x.reshape(-1, 40), 'row').view(2, 5, 40)
    # same operands; F.linear runs on the 3-D input with the bias fused (addmm), lowp_linear does mm on 2-D rows then
    # adds the bias, so the kernels (and their last bits) may differ
    torch.testing.assert_close(y, F.linear(xq, Q.fake_quant_nvfp4(w, block2d=True), b), rtol=1e-6, atol=1e-6)
    assert y.shape == F.linear(x, w).shape


def test_backward_operands_exact_without_sr_and_rht():
    "dX = q8(dY)·q8_along_out(W); dW = q8_along_tokens(dYᵀ)·q8_along_tokens(Xᵀ)ᵀ; db = sum dY (fp32)."
    torch.manual_seed(1)
    x, w, b = torch.randn(50, 40, requires_grad=True), torch.randn(24, 40, requires_grad=True), torch.randn(24, requires_grad=True)
    gy = torch.randn(50, 24)
    lowp_linear(x, w, b, cfg=EXACT).backward(gy)
    dx = fq8(gy) @ fq8(w.detach().t()).t()
    dw = fq8(gy.t()) @ fq8(x.detach().t()).t()
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw) and torch.equal(b.grad, gy.sum(0))


def test_backward_with_rht_exact():
    torch.manual_seed(2)
    x, w = torch.randn(37, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    gy = torch.randn(37, 16)
    lowp_linear(x, w, cfg=LowpConfig(sr=False, rht=True, rht_seed=5)).backward(gy)
    tg, tx = Q.rht(gy, 0, 5), Q.rht(x.detach(), 0, 5)
    assert torch.equal(w.grad, fq8(tg.t()) @ fq8(tx.t()).t())


@pytest.mark.parametrize('cfg,tol', [(LowpConfig(), 0.07), (EXACT, 0.06), (LowpConfig(grad_elem='e5m2'), 0.12),
                                     (LowpConfig(rule='floor'), 0.07)])
def test_gradients_close_to_fp32(cfg, tol):
    torch.manual_seed(3)
    x, w = torch.randn(256, 128), torch.randn(96, 128) / 11
    e = grad_errors(x, w, cfg)
    assert e['dx'] < tol and e['dw'] < tol, e
    assert e['dx'] > 1e-3 and e['dw'] > 1e-3          # it really is quantised


def test_sr_is_random_and_switchable():
    x, w = torch.randn(64, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)
    gy = torch.randn(64, 32)
    grads = []
    for seed in (0, 1):
        torch.manual_seed(seed); x.grad = None
        lowp_linear(x, w, cfg=LowpConfig(sr=True)).backward(gy); grads.append(x.grad.clone())
    assert not torch.equal(*grads)
    with lowp_config(sr=False, rht=False):
        a = torch.autograd.grad(lowp_linear(x, w), x, gy)[0]; b = torch.autograd.grad(lowp_linear(x, w), x, gy)[0]
    assert torch.equal(a, b)


def test_dtypes_and_errors():
    x, w = torch.randn(3, 32, dtype=torch.bfloat16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    y = lowp_linear(x, w); y.sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    with pytest.raises(ValueError, match='last dim'): lowp_linear(torch.randn(3, 31), w)
    with pytest.raises(ValueError, match='bias'): lowp_linear(torch.randn(3, 32), w, torch.randn(3))
    with pytest.raises(ValueError, match='w must be'): lowp_linear(torch.randn(3, 32), torch.randn(32))
    with pytest.raises(Exception, match='grad_elem'): LowpConfig(grad_elem='e3m4')


def test_grouped_linear_equals_naive_loop():
    torch.manual_seed(4)
    xs, ws = torch.randn(70, 24), torch.randn(4, 16, 24)
    for counts in ([20, 0, 35, 15], [70, 0, 0, 0], [0, 0, 0, 70]):
        naive, o = [], 0
        for e, n in enumerate(counts):
            naive.append(xs[o:o + n] @ ws[e].t()); o += n
        assert torch.equal(grouped_linear(xs, ws, torch.tensor(counts)), torch.cat(naive))
    assert grouped_linear(torch.zeros(0, 24), ws, [0, 0, 0, 0]).shape == (0, 16)
    with pytest.raises(ValueError, match='sum'): grouped_linear(xs, ws, [1, 2, 3, 4])
    with pytest.raises(ValueError, match='entries'): grouped_linear(xs, ws, [70])
    with pytest.raises(ValueError, match='features'): grouped_linear(xs, torch.randn(4, 16, 25), [70, 0, 0, 0])


def test_lowp_grouped_matches_per_expert_lowp_linear():
    "Without SR the grouped path is exactly lowp_linear applied to each expert's rows (forward and backward)."
    torch.manual_seed(5)
    counts = [20, 0, 33, 17]
    xs, ws = torch.randn(70, 48, requires_grad=True), torch.randn(4, 32, 48, requires_grad=True)
    gy = torch.randn(70, 32)
    y = lowp_grouped_linear(xs, ws, counts, cfg=LowpConfig(sr=False)); y.backward(gy)
    o = 0
    for e, n in enumerate(counts):
        if n == 0:
            assert torch.equal(ws.grad[e], torch.zeros(32, 48)); continue
        xe, we = xs.detach()[o:o + n].clone().requires_grad_(), ws.detach()[e].clone().requires_grad_()
        ye = lowp_linear(xe, we, cfg=LowpConfig(sr=False)); ye.backward(gy[o:o + n])
        assert torch.equal(y[o:o + n], ye) and torch.equal(xs.grad[o:o + n], xe.grad) and torch.equal(ws.grad[e], we.grad)
        o += n


def test_lowp_grouped_gradients_close_to_fp32():
    torch.manual_seed(6)
    counts = torch.tensor([100, 60, 0, 96])
    xs, ws = torch.randn(256, 64), torch.randn(4, 48, 64) / 8
    gy = torch.randn(256, 48)
    a, b = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    grouped_linear(a, b, counts).backward(gy)
    c, d = xs.clone().requires_grad_(), ws.clone().requires_grad_()
    lowp_grouped_linear(c, d, counts).backward(gy)
    rel = lambda p, q: ((p - q).norm() / q.norm()).item()
    assert rel(c.grad, a.grad) < 0.07 and rel(d.grad, b.grad) < 0.07


@pytest.mark.slow
def test_small_mlp_trains_close_to_fp32():
    kw = dict(d=32, h=64, batch=64, lr=1e-2)
    lf, ll = train_mlp('fp32', 80, **kw), train_mlp('lowp', 80, **kw)
    mf, ml = sum(lf[-10:]) / 10, sum(ll[-10:]) / 10
    assert ml < 0.3 * ll[0], (ll[0], ml)
    assert ml < 1.25 * mf, (mf, ml)


def test_model_runs_with_lowp_precision():
    model = pytest.importorskip('composer2.model')
    torch.manual_seed(0)
    cfg = model.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=16,
                            n_experts=4, top_k=2, d_expert=32, n_shared_experts=1, n_dense_layers=1, d_dense=48,
                            precision='nvfp4_mxfp8')
    m = model.Transformer(cfg)
    ids = torch.randint(0, 64, (2, 16))
    out = m(ids)
    logits = out.logits if hasattr(out, 'logits') else out
    F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad and p.grad is not None)
    assert m.layers[1].ffn.w13.grad.abs().sum() > 0 if hasattr(m, 'layers') else True


def _tiny_workspace(tmp_path):
    import numpy as np, yaml
    from composer2.model import ModelConfig, Transformer
    from composer2.train import save_checkpoint
    torch.manual_seed(0)
    base = Transformer(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32,
                                   n_experts=4, d_expert=32, d_dense=64))
    save_checkpoint(tmp_path / 'base', base)
    toks = np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16)
    for n in ('train', 'val', 'held'): toks.tofile(tmp_path / f'{n}.bin')
    sec = {'data': str(tmp_path / 'train.bin'), 'val': str(tmp_path / 'val.bin'), 'heldout': str(tmp_path / 'held.bin'),
           'init': str(tmp_path / 'base'), 'out_dir': str(tmp_path / 'out'), 'final_window': 2,
           'quant': {'rule': 'rceil', 'sr': True},
           'train': {'steps': 4, 'batch_size': 4, 'seq_len': 32, 'warmup_steps': 1, 'eval_every': 2, 'eval_windows': 2, 'seed': 3}}
    return base, sec


def test_lowp_stage_end_to_end(tmp_path, monkeypatch):
    import json, yaml
    from composer2.config import ConfigError
    from composer2.stages.lowp import run as stage
    from composer2.train import load_model
    base, sec = _tiny_workspace(tmp_path)
    (tmp_path / 'params.yaml').write_text(yaml.safe_dump({'lowp': sec}))
    monkeypatch.chdir(tmp_path)
    r = stage('params.yaml')
    m = json.loads((tmp_path / 'reports/metrics/lowp.json').read_text())
    assert m['arms'].keys() == {'high', 'nvfp4_mxfp8'} and m['steps'] == 4
    hi, lo = m['arms']['high'], m['arms']['nvfp4_mxfp8']
    # same start, same batches: the first losses differ only by the NVFP4 forward error
    assert hi['first_loss'] != lo['first_loss'] and abs(hi['first_loss'] - lo['first_loss']) < 0.02 * hi['first_loss']
    assert abs(m['gaps']['nvfp4_mxfp8']['rel_final_loss'] - (lo['final_loss'] - hi['final_loss']) / hi['final_loss']) < 1e-12
    assert [e['step'] for e in lo['eval_curve']] == [2, 4] and lo['heldout_ppl'] > 1 and lo['heldout_ppl_high_fwd'] > 1
    for arm in ('high', 'nvfp4_mxfp8'):
        assert (tmp_path / f'reports/live/lowp/{arm}/plots/metrics/train/loss.tsv').exists()
        mdl, meta = load_model(tmp_path / f'out/{arm}/ckpt')
        assert mdl.cfg.precision == arm and meta['init'] == sec['init'] and meta['stage'] == f'lowp_{arm}'
    # reuse of the high arm: accepted for the identical budget (same numbers), refused for any other
    sec2 = {**sec, 'reuse_high': str(tmp_path / 'out/high/ckpt'), 'arms': ['high'], 'out_dir': str(tmp_path / 'out2')}
    (tmp_path / 'p2.yaml').write_text(yaml.safe_dump({'lowp': sec2}))
    r2 = stage('p2.yaml')
    assert r2['arms']['high']['final_loss'] == hi['final_loss'] and 'reused_from' in r2['arms']['high']
    (tmp_path / 'p3.yaml').write_text(yaml.safe_dump({'lowp': {**sec2, 'train': {**sec['train'], 'lr': 0.01}}}))
    with pytest.raises(ConfigError, match='train_config'): stage('p3.yaml')


def test_lowp_stage_config_errors(tmp_path):
    import yaml
    from composer2.config import ConfigError
    from composer2.stages.lowp import run as stage
    for bad, msg in [({'arms': ['high', 'fp4']}, 'arms'), ({'arms': ['high', 'high']}, 'arms'), ({'final_window': 0}, 'final_window'),
                     ({'quant': {'rule': 'ceil'}}, 'rule'), ({'context_factor': 2, 'rope_scaling': 'yarn'}, 'context_factor'),
                     ({'precison': 'x'}, 'unknown key')]:
        (tmp_path / 'p.yaml').write_text(yaml.safe_dump({'lowp': bad}))
        with pytest.raises(ConfigError, match=msg): stage(str(tmp_path / 'p.yaml'))


# ---------------------------------------------------------------- the fast CPU path == the reference path, bit for bit
def _bits(t): return t.contiguous().view(torch.int32)


def _run(fn, x, w, gy, kernels, seed=5):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.manual_seed(seed)
    with lowp_config(kernels=kernels): y = fn(xs, ws); y.backward(gy)
    return y, xs.grad, ws.grad, torch.rand(4)                         # the stream after: the same draws were made


@pytest.mark.numerics
@pytest.mark.parametrize('cfg', [dict(), dict(grad_elem='e5m2', rule='floor'), dict(sr=False, rht=False)])
def test_fast_path_bit_identical_linear_and_grouped(cfg):
    g = torch.Generator().manual_seed(0)
    with lowp_config(**cfg):
        for (N, d, h) in [(70, 48, 40), (64, 64, 96)]:
            x, w = torch.randn(N, d, generator=g), torch.randn(h, d, generator=g) / 7
            gy = torch.randn(N, h, generator=g)
            ref, fast = _run(lowp_linear, x, w, gy, False), _run(lowp_linear, x, w, gy, True)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, fast))
        for counts, (d, h) in [([30, 0, 17, 1, 52], (48, 40)), ([64, 64, 0, 128], (64, 2 * 96))]:   # 2h: fused w1||w3
            N, E = sum(counts), len(counts)
            x, w = torch.randn(N, d, generator=g), torch.randn(E, h, d, generator=g) / 7
            gy = torch.randn(N, h, generator=g)
            fn = lambda a, b: lowp_grouped_linear(a, b, counts)
            ref, fast = _run(fn, x, w, gy, False), _run(fn, x, w, gy, True)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, fast))


@pytest.mark.numerics
def test_fast_path_bit_identical_model_step():
    from composer2.model import ModelConfig, Transformer
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32, n_experts=4,
                      top_k=2, d_expert=48, n_shared_experts=1, precision='nvfp4_mxfp8')
    ids = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(0))
    runs = []
    for kernels in (False, True):
        torch.manual_seed(0); m = Transformer(cfg)
        with lowp_config(kernels=kernels):
            torch.manual_seed(1)
            out = m(ids[:, :-1])
            F.cross_entropy(out.logits.reshape(-1, 64), ids[:, 1:].reshape(-1)).backward()
        runs.append([p.grad for p in m.parameters()] + [out.logits.detach(), torch.rand(4)])
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(*runs))
