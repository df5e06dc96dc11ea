"The trainer: exact resume, accumulation, corrupt checkpoints, DeepSpeed parity (2 gloo processes vs 1)."
import json, os, subprocess, sys, textwrap
import numpy as np, pytest, torch
import torch.nn.functional as F
from conftest import ROOT, BIN, tiny_cfg
from composer2.model import Transformer
from composer2.train import (Batch, CheckpointError, TrainConfig, WindowSampler, load_model, read_meta,
                             save_checkpoint, train)

STREAM = (np.arange(3000) * 7 % 97).astype(np.uint16)

def run(tmp, steps=8, stop_after=None, seed_model=0, model_kw=None, **kw):
    torch.manual_seed(seed_model); m = Transformer(tiny_cfg(**(model_kw or {})))
    cfg = TrainConfig(steps=steps, batch_size=4, seq_len=16, lr=5e-3, warmup_steps=2, eval_every=10**6, **kw)
    return m, train(m, cfg, WindowSampler(STREAM, 16, 4, seed=3), tmp, stage='t', stop_after=stop_after)

def test_resume_gives_the_same_loss_trajectory(tmp_path):
    _, straight = run(tmp_path / 'a', steps=10)
    run(tmp_path / 'b', steps=10, stop_after=5)
    assert read_meta(tmp_path / 'b' / 'ckpt')['step'] == 5
    m, resumed = run(tmp_path / 'b', steps=10, seed_model=123)   # different init: everything must come from the checkpoint
    # exact: the resumed run repeats the same computation on the same batches and shapes (exact resume is the claim)
    assert resumed['loss'] == straight['loss'] and resumed['step'] == list(range(1, 11))
    m2, _ = load_model(tmp_path / 'a' / 'ckpt')
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()): assert torch.equal(a, b), n

@pytest.mark.numerics
def test_gradient_accumulation_matches_full_batch(tmp_path):
    # the load-balancing loss is a product of batch statistics, so it is only additive per micro-batch: switch it off
    _, full = run(tmp_path / 'a', steps=4, model_kw={'aux_loss_coef': 0.0})
    _, acc = run(tmp_path / 'b', steps=4, micro_batch_size=1, model_kw={'aux_loss_coef': 0.0})
    # toleranced: micro-batches of 1 vs a batch of 4 (other GEMM shapes, another summation order)
    np.testing.assert_allclose(acc['loss'], full['loss'], rtol=1e-5)

def test_corrupt_and_missing_checkpoints_are_named(tmp_path):
    m = Transformer(tiny_cfg()); ck = save_checkpoint(tmp_path / 'ck', m, step=3, meta={'stage': 'x'})
    meta = read_meta(ck); assert meta['step'] == 3 and meta['model_config']['d_model'] == 32 and 'git_commit' not in meta
    w = ck / 'model.safetensors'; w.write_bytes(w.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match='model.safetensors is corrupt or truncated'): load_model(ck)
    w.unlink()
    with pytest.raises(CheckpointError, match='model.safetensors is missing'): load_model(ck)
    with pytest.raises(CheckpointError, match='does not exist'): load_model(tmp_path / 'nowhere')
    (ck / 'meta.json').write_text('{"step": 1,')
    with pytest.raises(CheckpointError, match='meta.json is corrupt'): load_model(ck)

def test_overwrite_is_atomic_and_leaves_no_temp_dirs(tmp_path):
    m = Transformer(tiny_cfg())
    save_checkpoint(tmp_path / 'ck', m, step=1); save_checkpoint(tmp_path / 'ck', m, step=2)
    assert read_meta(tmp_path / 'ck')['step'] == 2 and [p.name for p in tmp_path.iterdir()] == ['ck']

def test_nonfinite_loss_stops_with_a_clear_error(tmp_path):
    m = Transformer(tiny_cfg())
    with torch.no_grad(): m.head.weight.fill_(float('nan'))
    with pytest.raises(FloatingPointError, match='loss became nan at step 0'):
        train(m, TrainConfig(steps=2, batch_size=2, seq_len=8, warmup_steps=0), WindowSampler(STREAM, 8, 2), tmp_path, stage='nan')

WORKER = textwrap.dedent('''
    import json, sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_cfg
    from composer2.model import Transformer
    from composer2.train import TrainConfig, WindowSampler, train
    torch.set_num_threads(1); torch.manual_seed(0)
    m = Transformer(tiny_cfg(n_shared_experts=0, aux_loss_coef=0.0))
    stream = (np.arange(3000) * 7 % 97).astype(np.uint16)
    cfg = TrainConfig(steps=4, batch_size=4, micro_batch_size=1, seq_len=16, lr=5e-3, warmup_steps=1,
                      eval_every=10**6, zero_stage={zero})
    h = train(m, cfg, WindowSampler(stream, 16, 4, seed=3), sys.argv[1], stage='ds')
    if torch.distributed.get_rank() == 0: open(sys.argv[2], 'w').write(json.dumps(h['loss']))
''')

@pytest.mark.slow
@pytest.mark.numerics
@pytest.mark.parametrize('zero', [1])
def test_deepspeed_two_gloo_processes_match_single_process(tmp_path, zero):
    w = tmp_path / 'worker.py'; w.write_text(WORKER.format(tests=str(ROOT / 'tests'), zero=zero))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PATH': f"{BIN}:{os.environ['PATH']}"}
    r = subprocess.run([str(BIN / 'deepspeed'), '--no_local_rank', '--num_gpus', '2', '--master_port', str(29500 + os.getpid() % 1000),
                        str(w), str(tmp_path / 'out'), str(tmp_path / 'loss.json')],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ds_loss = json.loads((tmp_path / 'loss.json').read_text())
    torch.manual_seed(0); m = Transformer(tiny_cfg(n_shared_experts=0, aux_loss_coef=0.0))
    cfg = TrainConfig(steps=4, batch_size=4, micro_batch_size=1, seq_len=16, lr=5e-3, warmup_steps=1, eval_every=10**6)
    single = train(m, cfg, WindowSampler(STREAM, 16, 4, seed=3), tmp_path / 'single', stage='ds')['loss']
    # toleranced: two ranks and an all-reduce (and DeepSpeed's loss scaling) vs one process
    np.testing.assert_allclose(ds_loss, single, rtol=2e-4)
    assert len(ds_loss) == 4 and ds_loss[-1] < ds_loss[0]

def test_masked_ce_equals_cross_entropy_reference():
    from composer2.train import masked_ce
    torch.manual_seed(0)
    z = torch.randn(2, 25, 300, requires_grad=True); y = torch.randint(0, 300, (2, 25)); y[0, 3] = -100
    m = (torch.rand(2, 25) > 0.3).long()
    s, c = masked_ce(z, y, m); s.backward()
    z2 = z.detach().double().requires_grad_(); mm = m.reshape(-1).double() * (y.reshape(-1) != -100)
    ref = (F.cross_entropy(z2.reshape(-1, 300), y.reshape(-1), reduction='none') * mm).sum(); ref.backward()
    assert c == mm.sum()
    # toleranced: fp32 one-pass logsumexp vs an fp64 log-softmax
    torch.testing.assert_close(s.double(), ref, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(z.grad.double(), z2.grad, atol=1e-7, rtol=1e-5)

@pytest.mark.numerics
def test_masked_ce_in_row_blocks_equals_the_reference_across_blocks(monkeypatch):
    "More rows than `_CE_ROWS` (blocks of 512, the last one partial): the fp64 reference, and a 1-block run within fp32 rounding."
    import composer2.train as T
    torch.manual_seed(1)
    z = (3 * torch.randn(1300, 257)).requires_grad_(); y = torch.randint(0, 257, (1300,)); y[7] = y[900] = -100
    m = (torch.rand(1300) > 0.4).long()
    s, c = T.masked_ce(z, y, m); s.backward()
    z2 = z.detach().double().requires_grad_(); mm = m.double() * (y != -100)
    ref = (F.cross_entropy(z2, y, reduction='none') * mm).sum(); ref.backward()
    assert c == mm.sum() and T._CE_ROWS < 1300
    # toleranced: fp32 blocked logsumexp vs an fp64 log-softmax
    torch.testing.assert_close(s.double(), ref, atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(z.grad.double(), z2.grad, atol=1e-7, rtol=1e-5)
    # toleranced: one block vs 512-row blocks (same per-row formula; a reduction over rows may vectorise differently)
    monkeypatch.setattr(T, '_CE_ROWS', 1 << 30)
    z3 = z.detach().clone().requires_grad_(); s3, _ = T.masked_ce(z3, y, m); s3.backward()
    torch.testing.assert_close(s3, s, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(z3.grad, z.grad, atol=1e-8, rtol=1e-6)

@pytest.mark.numerics
def test_head_ce_equals_the_fp64_reference_across_blocks():
    "The head applied in row blocks (`head_ce`: 1300 rows, blocks of 256, the last partial) against fp64 cross entropy of full logits."
    import composer2.train as T
    torch.manual_seed(2)
    h = torch.randn(1300, 48, requires_grad=True); w = (0.3 * torch.randn(257, 48)).requires_grad_()
    y = torch.randint(0, 257, (1300,)); y[5] = y[1000] = -100; m = (torch.rand(1300) > 0.4).long()
    s, c = T.head_ce(h, w, y, m); s.backward()
    h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_(); mm = m.double() * (y != -100)
    ref = (F.cross_entropy(h2 @ w2.t(), y, reduction='none') * mm).sum(); ref.backward()
    assert c == mm.sum() and T._HEAD_ROWS < 1300
    # toleranced: fp32 GEMMs and blocked sums vs fp64 over the whole logits
    torch.testing.assert_close(s.double(), ref, atol=1e-3, rtol=1e-6)
    torch.testing.assert_close(h.grad.double(), h2.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.grad.double(), w2.grad, atol=1e-5, rtol=1e-5)     # a sum over 1300 rows in fp32
    assert (h.grad[mm == 0] == 0).all()         # rows that count nothing are left out: exactly no gradient

def test_head_ce_with_no_row_counted():
    "Every row masked or -100: a zero loss, zero gradients, no error (an SFT batch of prompts only)."
    from composer2.train import head_ce
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    y = torch.randint(0, 20, (6,)); y[0] = -100
    s, c = head_ce(h, w, y, torch.tensor([1, 0, 0, 0, 0, 0]))
    s.backward()
    assert c == 0 and s == 0 and (h.grad == 0).all() and (w.grad == 0).all()

def test_head_ce_without_a_gradient_and_with_bad_shapes():
    from composer2.train import head_ce
    torch.manual_seed(0)
    h, w, y, m = torch.randn(10, 8), torch.randn(20, 8), torch.randint(0, 20, (10,)), torch.ones(10)
    s, c = head_ce(h, w, y, m)                                  # nothing requires a gradient: the loss alone
    assert not s.requires_grad and c == 10
    torch.testing.assert_close(s, F.cross_entropy(h @ w.t(), y, reduction='sum'), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match='8 features, the head weight 9'): head_ce(h, torch.randn(20, 9), y, m)
    with pytest.raises(ValueError, match='10 rows of h, 5 targets'): head_ce(h, w, y[:5], m[:5])

@pytest.mark.numerics
def test_the_trainer_applies_the_head_in_blocks_and_matches_full_logits(tmp_path, monkeypatch):
    "A tied-embedding model: loss and every gradient as from `masked_ce` over the full logits; `train` takes this path."
    import composer2.train as T
    torch.manual_seed(0); m = Transformer(tiny_cfg(tie_embeddings=True)); x = torch.randint(0, 97, (4, 40))
    y, mask = torch.roll(x, -1, 1), (torch.rand(4, 40) > 0.2).long()
    s_ref, _ = T.masked_ce(m(x).logits, y, mask); s_ref.backward()
    g_ref = {n: p.grad.clone() for n, p in m.named_parameters()}; m.zero_grad()
    out = m(x, head=False)
    assert out.logits is None and out.head_in.shape == (4, 40, 32)
    s, _ = T.head_ce(out.head_in, m.head.weight, y, mask); s.backward()
    # toleranced: the head's GEMMs in 256-row blocks and the loss summed per block vs one GEMM over all rows
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-4)
    for n, p in m.named_parameters(): torch.testing.assert_close(p.grad, g_ref[n], rtol=1e-4, atol=1e-7, msg=n)
    def full_logits(*a, **k): raise AssertionError('the single-process trainer built the full logits')
    monkeypatch.setattr(T, 'masked_ce', full_logits)
    _, hist = run(tmp_path, steps=3)
    assert len(hist['loss']) == 3 and all(np.isfinite(hist['loss']))
