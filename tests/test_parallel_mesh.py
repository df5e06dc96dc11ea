"""`train` on a DP × EP × TP × CP device mesh (FSDP2, torch tensor parallel, EPMoE all-to-all, ring attention) on 4 gloo
processes against the single-process run of the same code at the same seed; DeepSpeed + EP is refused."""
import os
import numpy as np, pytest, torch
import torch.distributed as dist

from composer2.config import ConfigError
from composer2.model import ModelConfig, Transformer
from composer2.mesh import ParallelConfig
from composer2.parallel import ParallelDims, spawn_local
from composer2.train import TrainConfig, WindowSampler, perplexity, train

STEPS = 6
STREAM = (np.arange(4000) * 7 % 61 + (np.arange(4000) // 13) % 3).astype(np.uint16)

def _cfg(): return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
                               d_expert=16, n_shared_experts=1, n_dense_layers=1, d_dense=48, max_seq_len=32, aux_loss_coef=0.01)

def _tc(micro=0, **par): return TrainConfig(steps=STEPS, batch_size=4, micro_batch_size=micro, seq_len=16, lr=2e-2, warmup_steps=1,
                                            schedule='constant', eval_every=3, eval_windows=2, seed=3, parallel=ParallelConfig(**par))

def _run(out_dir, micro=0, **par):
    torch.manual_seed(0); model = Transformer(_cfg())
    ev = lambda m: {'ppl': perplexity(m, STREAM[:600], 16, 2)}
    h = train(model, _tc(micro, **par), WindowSampler(STREAM, 16, 4, seed=3), out_dir, stage='mesh', eval_fn=ev)
    return h, {n: p.detach().clone() for n, p in model.named_parameters()}

def _worker(rank, world, out_dir, par, micro=0):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    h, w = _run(out_dir, micro, **par)
    return dict(loss=h['loss'], gn=h['grad_norm'], eval=h['eval'], tokens=h['tokens'], mesh=h['mesh'], weights=w)

_SINGLE = {}
def single(tmp_path_factory):
    if not _SINGLE:
        h, w = _run(tmp_path_factory.mktemp('single'))
        _SINGLE.update(h=h, w=w)
    return _SINGLE['h'], _SINGLE['w']

def _compare(res, h, w):
    assert max(abs(a - b) for a, b in zip(h['loss'], h['loss'][1:])) > 0.05        # the loss really moves
    assert h['loss'][0] - h['loss'][-1] > 0.5
    for r in res:
        np.testing.assert_allclose(r['loss'], h['loss'], rtol=1e-5)
        np.testing.assert_allclose(r['gn'], h['grad_norm'], rtol=1e-4)
        assert r['tokens'] == h['tokens'] and [e['step'] for e in r['eval']] == [3, 6]
        np.testing.assert_allclose([e['ppl'] for e in r['eval']], [e['ppl'] for e in h['eval']], rtol=1e-5)
        big = max(p.abs().max().item() for p in w.values())
        err = max((r['weights'][n] - w[n]).abs().max().item() for n in w) / big
        assert err < 1e-4, err
    moved = max((w[n] - p).abs().max().item() for n, p in _init().items())
    assert moved > 1e-2                                                    # lr x steps: the weights moved
    wrel = max(max((r['weights'][n] - w[n]).abs().max().item() for n in w) for r in res) / big
    lrel = max(max(abs(a - b) / abs(b) for a, b in zip(r['loss'], h['loss'])) for r in res)
    print(f"loss {h['loss'][0]:.4f} -> {h['loss'][-1]:.4f}; max loss rel diff {lrel:.2e}, max weight diff / max |w| {wrel:.2e}, "
          f"weights moved {moved:.3f}")
    return lrel

def _init():
    torch.manual_seed(0); return dict(Transformer(_cfg()).named_parameters())

# sharded vs whole GEMMs, all-to-all, reduce-scatter order: toleranced (loss 1e-5 rel, weights 1e-4). Two layouts, which
# between them shard by TP, CP, EP and DP, also run in `make test`'s pass on ATen's portable kernels (marked numerics);
# the other three differ from them in how ranks are grouped, not in the kernels a rank runs.
@pytest.mark.parametrize('par', [dict(dp=2, ep=2), pytest.param(dict(dp=2, tp=2), marks=pytest.mark.numerics),
                                 pytest.param(dict(cp=2, ep=2), marks=pytest.mark.numerics), dict(dp=4), dict(ep=2, tp=2)],
                         ids=['dp2xep2', 'dp2xtp2', 'cp2xep2', 'dp4', 'ep2xtp2'])
def test_mesh_matches_single_process(par, tmp_path, tmp_path_factory):
    res = spawn_local(_worker, 4, str(tmp_path / 'mesh'), par)
    h, w = single(tmp_path_factory)
    print(par, end=': '); _compare(res, h, w)
    d = ParallelConfig(**par).dims()
    for rank, r in enumerate(res):
        _check_shapes(r['mesh']['shapes'], r['mesh']['coords'], d)

@pytest.mark.numerics
def test_mesh_gradient_accumulation_matches_single_process(tmp_path):
    "dp2 x cp2, 2 micro-batches of 1 sequence per replica vs one process with 2 micro-batches of 2: the same micro-batches\n    (WindowSampler's rank::world rows), so the balance loss is exact per micro-batch too."
    res = spawn_local(_worker, 4, str(tmp_path / 'mesh'), dict(dp=2, cp=2), 1)
    h, w = _run(tmp_path / 'single', micro=2)
    print('accumulation', end=': '); _compare(res, h, w)

def _check_shapes(shapes, c, d):
    "Each rank's stored shards: FSDP2 dim-0 shards over dp·cp (experts over edp), TP column/row halves, EP expert slices."
    import math
    cfg = _cfg(); fs = d.dp * d.cp; El = cfg.n_experts // d.ep
    part = lambda n, k, i: len(range(n)[i * math.ceil(n / k):(i + 1) * math.ceil(n / k)])   # FSDP2's dim-0 chunks
    i_fs = c['dp'] * d.cp + c['cp']
    hd = cfg.d_model // cfg.n_heads
    assert shapes['embed.weight'] == (part(cfg.vocab_size, fs, i_fs), cfg.d_model)
    assert shapes['layers.0.attn.wq.weight'] == (part(cfg.n_heads * hd // d.tp, fs, i_fs), cfg.d_model)
    assert shapes['layers.0.attn.wo.weight'] == (part(cfg.d_model, fs, i_fs), cfg.n_heads * hd // d.tp)
    assert shapes['layers.0.ffn.w1.weight'] == (part(cfg.d_dense // d.tp, fs, i_fs), cfg.d_model)
    assert shapes['layers.1.ffn.experts.w13'] == (part(El, d.edp, c['edp']), 2 * cfg.d_expert, cfg.d_model)
    assert shapes['layers.1.ffn.router.weight'] == (part(cfg.n_experts, fs, i_fs), cfg.d_model)
    assert shapes['layers.1.ffn.shared.w2.weight'] == (part(cfg.d_model, fs, i_fs), cfg.d_expert // d.tp)

# ---- `composer2 stage base` under torchrun (4 processes, dp2 x ep2) against the same stage in one process ----

def _stage_workspace(root, run, par=None):
    "Tokenizer, token streams and a params file for the `base` stage (from scratch: shared expert, balance loss on)."
    import yaml
    from composer2.tokenizer import Tokenizer, save_stream
    if not (root / 'tok' / 'tokenizer.json').exists():
        tok = Tokenizer.train([f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)], vocab_size=128, min_frequency=1)
        tok.save(root / 'tok' / 'tokenizer.json')
        for s in ('general', 'code_val', 'heldout'): save_stream(root / 'tokens' / f'{s}.bin', STREAM[:3000] % tok.vocab_size)
    model = dict(vocab_size=Tokenizer.load(root / 'tok').vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                 n_experts=4, top_k=2, d_expert=16, n_shared_experts=1, n_dense_layers=1, d_dense=48, max_seq_len=16,
                 aux_loss_coef=0.01)
    train = dict(steps=5, batch_size=4, seq_len=16, lr=2e-2, warmup_steps=1, schedule='constant', eval_every=5,
                 eval_windows=2, threads=1, seed=3)
    if par: train['parallel'] = par
    base = dict(data=str(root / 'tokens/general.bin'), val=str(root / 'tokens/code_val.bin'), heldout=str(root / 'tokens/heldout.bin'),
                tokenizer=str(root / 'tok'), out_dir=str(root / run / 'base'), train=train)
    (root / run).mkdir(parents=True, exist_ok=True)
    p = root / run / 'params.yaml'; p.write_text(yaml.safe_dump({'model': model, 'base': base})); return p

@pytest.mark.numerics
def test_base_stage_under_torchrun_matches_single_process(tmp_path, monkeypatch):
    import json, subprocess, sys
    from safetensors.torch import load_file
    from composer2.stages.pretrain import base
    from composer2.train import read_meta
    p1 = _stage_workspace(tmp_path, 'single')
    monkeypatch.chdir(tmp_path / 'single'); single = base(p1)
    p4 = _stage_workspace(tmp_path, 'mesh', dict(dp=2, ep=2))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(__import__('pathlib').Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '4',
                        '-m', 'composer2.cli', 'stage', 'base', '--params', str(p4)],
                       cwd=tmp_path / 'mesh', env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    mesh = json.loads((tmp_path / 'mesh/reports/metrics/base.json').read_text())
    hm, hs = read_meta(tmp_path / 'mesh/base/ckpt'), read_meta(tmp_path / 'single/base/ckpt')
    assert hm['train_config']['parallel'] == dict(dp=2, ep=2, tp=1, cp=1) and mesh['tokens'] == single['tokens'] == 5 * 4 * 16
    np.testing.assert_allclose(hm['history']['loss'], hs['history']['loss'], rtol=1e-5)
    assert hs['history']['loss'][0] - hs['history']['loss'][-1] > 0.1          # ~2000x the loss tolerance
    np.testing.assert_allclose(mesh['val_ppl'], single['val_ppl'], rtol=1e-4)
    ws, wm = load_file(str(tmp_path / 'single/base/ckpt/model.safetensors')), load_file(str(tmp_path / 'mesh/base/ckpt/model.safetensors'))
    assert set(ws) == set(wm)
    big = max(t.abs().max().item() for t in ws.values())
    assert max((ws[n] - wm[n]).abs().max().item() for n in ws) / big < 1e-4

def test_parallel_config_errors_say_which_rule_broke(tmp_path):
    from composer2.config import from_dict
    from composer2.mesh import validate_parallel
    cfg = _cfg()
    def err(par, world, **kw):
        with pytest.raises(ConfigError) as e: validate_parallel(ParallelConfig(**par), world, cfg, **kw)
        return str(e.value)
    assert 'world size 8' in err(dict(dp=2, ep=2), 8)                              # the product is the process count
    assert 'must divide model.n_experts (4)' in err(dict(ep=8), 8)
    assert 'n_heads (4)' in err(dict(tp=8), 8) or 'n_kv_heads' in err(dict(tp=8), 8)
    assert 'n_kv_heads (2)' in err(dict(tp=4), 4)
    assert 'batch_size (6) must be divisible by dp*ep (4)' in err(dict(dp=2, ep=2), 4, batch_size=6)
    assert 'seq_len (3)' in err(dict(cp=2), 2, seq_len=3)
    ds = err(dict(dp=2, ep=2), 4, deepspeed=True)
    assert 'DeepSpeed' in ds and 'mesh path' in ds and 'torchrun' in ds
    assert 'needs MoE layers' in str(pytest.raises(ConfigError, validate_parallel, ParallelConfig(ep=2), 2,
                                                   ModelConfig(n_layers=2, n_dense_layers=2)).value)
    assert 'bias_update_rate' in str(pytest.raises(ConfigError, validate_parallel, ParallelConfig(dp=2), 2,
                                                   ModelConfig(bias_update_rate=0.01)).value)
    with pytest.raises(ConfigError, match='integer >= 1'): ParallelConfig(ep=0)
    with pytest.raises(ConfigError, match="unknown key 'dq'"): from_dict(TrainConfig, {'parallel': {'dq': 2}})
    assert from_dict(TrainConfig, {'parallel': {'dp': 2, 'ep': 2}}).parallel == ParallelConfig(dp=2, ep=2)
    # a single process asking for parallelism: the mesh path checks the world before building anything
    with pytest.raises(ConfigError, match='world size 1'):
        train(Transformer(_cfg()), _tc(dp=2), WindowSampler(STREAM, 16, 4), tmp_path)
