"""Expert parallelism under the DeepSpeed path is refused at start (its engine would average the expert gradients over
all ranks), and the mesh path trains the same EP layout to the single-process weights."""
import os
import numpy as np, pytest, torch

from composer2.config import ConfigError
from composer2.mesh import ParallelConfig
from composer2.model import ModelConfig, Transformer
from composer2.parallel import shard_experts, spawn_local
from composer2.train import TrainConfig, WindowSampler, train

STREAM = (np.arange(3000) * 7 % 61).astype(np.uint16)

def _cfg(): return ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
                               d_expert=16, n_shared_experts=0, n_dense_layers=1, d_dense=48, max_seq_len=32, aux_loss_coef=0.0)

def _tc(**kw): return TrainConfig(steps=5, batch_size=4, seq_len=16, lr=2e-2, warmup_steps=1, schedule='constant',
                                  eval_every=10 ** 6, seed=3, **kw)

def _model(): torch.manual_seed(0); return Transformer(_cfg())

def _experts(model):
    return {f'layers.{i}.ffn.{w}': getattr(l.ffn, w).detach().clone() for i, l in enumerate(model.layers) if l.is_moe for w in ('w13', 'w2')}

def _worker(rank, world, out):
    import torch.distributed as dist
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    res = {}
    m = shard_experts(_model(), None)                          # experts sharded over the 2 ranks (EP = 2)
    try:                                                       # the DeepSpeed path (a launch without train.parallel)
        train(m, _tc(zero_stage=1), WindowSampler(STREAM, 16, 4, seed=3), f'{out}/ds', stage='ds')
        ex = {}
        for n, t in _experts(m).items():                       # what today's code trained: gather the EP shards
            parts = [torch.empty_like(t) for _ in range(world)]; dist.all_gather(parts, t.contiguous()); ex[n] = torch.cat(parts)
        res['ds_experts'] = ex
    except ConfigError as e: res['refused'] = str(e)
    try: train(_model(), _tc(zero_stage=1, parallel=ParallelConfig(ep=2)), WindowSampler(STREAM, 16, 4, seed=3), f'{out}/ds2')
    except ConfigError as e: res['refused_par'] = str(e)
    m = _model()                                                # the mesh path: the same EP layout, right gradients
    h = train(m, _tc(parallel=ParallelConfig(ep=2)), WindowSampler(STREAM, 16, 4, seed=3), f'{out}/mesh', stage='mesh')
    res.update(mesh_loss=h['loss'], mesh_experts=_experts(m), mesh_w={n: p.detach().clone() for n, p in m.named_parameters()})
    return res

@pytest.mark.numerics
def test_deepspeed_with_ep_is_refused_and_the_mesh_path_trains_it(tmp_path):
    res = spawn_local(_worker, 2, str(tmp_path))
    m = _model(); init = _experts(m)
    h = train(m, _tc(), WindowSampler(STREAM, 16, 4, seed=3), tmp_path / 'single', stage='single')
    single = _experts(m); w = {n: p.detach() for n, p in m.named_parameters()}
    assert max((single[n] - init[n]).abs().max().item() for n in single) > 1e-2          # the experts moved
    big = max(p.abs().max().item() for p in w.values())
    for r in res:
        if 'ds_experts' in r:          # today's code: DeepSpeed averaged the expert gradients over the EP ranks
            err = max((r['ds_experts'][n] - single[n]).abs().max().item() for n in single) / big
            pytest.fail(f"EP under DeepSpeed was not refused; its experts end {err:.3g} (relative) from the single-process run")
        assert 'EPMoE' in r['refused'] and 'mesh path' in r['refused'], r['refused']
        assert 'DeepSpeed' in r['refused_par'] and 'mesh path' in r['refused_par'], r['refused_par']
        np.testing.assert_allclose(r['mesh_loss'], h['loss'], rtol=1e-5)
        assert max((r['mesh_w'][n] - w[n]).abs().max().item() for n in w) / big < 1e-4
