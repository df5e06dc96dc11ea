"""Mesh checkpoints through torch.distributed.checkpoint (4 gloo processes): exact resume on dp2 x ep2, a mesh
checkpoint read in one process (consolidated weights, identical logits), single-process <-> mesh resume, and resume on
another mesh."""
import os
import numpy as np, pytest, torch

from composer2.mesh import ParallelConfig, read_dcp
from composer2.model import Transformer
from composer2.parallel import spawn_local
from composer2.train import CheckpointError, TrainConfig, WindowSampler, load_model, read_meta, train

from test_parallel_mesh import STREAM, _cfg

STEPS = 6
IDS = torch.tensor([[int(t) for t in STREAM[i:i + 16]] for i in (0, 100)])

def _run(out_dir, stop_after=None, seed=0, **par):
    torch.manual_seed(seed); model = Transformer(_cfg())
    tc = TrainConfig(steps=STEPS, batch_size=4, seq_len=16, lr=2e-2, warmup_steps=1, schedule='cosine', min_lr_ratio=0.3,
                     eval_every=10 ** 6, seed=3, parallel=ParallelConfig(**par))
    h = train(model, tc, WindowSampler(STREAM, 16, 4, seed=3), out_dir, stage='mesh', stop_after=stop_after)
    with torch.no_grad(): logits = model(IDS).logits
    return dict(loss=h['loss'], gn=h['grad_norm'], step=h['step'], logits=logits,
                weights={n: p.detach().clone() for n, p in model.named_parameters()})

def _worker(rank, world, out_dir, stop_after, seed, par):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return _run(out_dir, stop_after, seed, **par)

def _close(r, ref, what):
    "Losses per step within 1e-5 relative, final weights within 1e-4 of the largest weight."
    np.testing.assert_allclose(r['loss'], ref['loss'], rtol=1e-5, err_msg=what)
    np.testing.assert_allclose(r['gn'], ref['gn'], rtol=1e-5, err_msg=what)             # the whole gradient's norm
    big = max(p.abs().max().item() for p in ref['weights'].values())
    err = max((r['weights'][n] - ref['weights'][n]).abs().max().item() for n in ref['weights']) / big
    lrel = max(abs(a - b) / abs(b) for a, b in zip(r['loss'], ref['loss']))
    print(f"{what}: max loss rel diff {lrel:.2e}, max weight diff / max |w| {err:.2e}")
    assert err < 1e-4, (what, err)

DP2EP2 = dict(dp=2, ep=2)

def _worker_both(rank, world, root):
    "dp2 x ep2 in the same 4 processes: the straight run (root/a) and the run stopped half way (root/b)."
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return _run(f'{root}/a', None, 0, **DP2EP2), _run(f'{root}/b', STEPS // 2, 0, **DP2EP2)

_MESH = {}
def _mesh_half(tmp_path_factory, dst):
    "The dp2 x ep2 runs (once per session); copies the half-way checkpoint to `dst/ckpt`; (straight, half) per rank."
    import shutil
    if not _MESH:
        root = tmp_path_factory.mktemp('mesh'); _MESH.update(root=root, res=spawn_local(_worker_both, 4, str(root)))
    shutil.copytree(_MESH['root'] / 'b' / 'ckpt', dst / 'ckpt')
    return [a for a, _ in _MESH['res']], [b for _, b in _MESH['res']]

_SINGLE = {}
def _single(tmp_path_factory):
    if not _SINGLE: _SINGLE.update(_run(tmp_path_factory.mktemp('single')))
    return _SINGLE

@pytest.mark.numerics      # the resumed run is the same computation on the same shards: bit-identical here, asserted toleranced
def test_mesh_resume_is_exact_and_the_checkpoint_reads_in_one_process(tmp_path, tmp_path_factory):
    straight, half = _mesh_half(tmp_path_factory, tmp_path)
    ck = tmp_path / 'ckpt'; meta = read_meta(ck)
    assert meta['step'] == STEPS // 2 and sorted(meta['dcp']) == ['.metadata'] + [f'__{r}_0.distcp' for r in range(4)]
    assert not (ck / 'optimizer.pt').exists() and meta['scheduler']['last_epoch'] == STEPS // 2
    # one process: the consolidated weights, DCP's shards put together and the ranks' whole model agree bit for bit
    w = read_dcp(ck / 'dcp'); m, _ = load_model(ck)
    assert set(w) == {n for n, _ in m.named_parameters()}
    assert all(torch.equal(w[n], p) for n, p in m.named_parameters())
    with torch.no_grad(): logits = m(IDS).logits
    assert all(torch.equal(logits, r['logits']) for r in half)           # identical logits in one process
    resumed = spawn_local(_worker, 4, str(tmp_path), None, 123, DP2EP2)   # another init: all comes from the checkpoint
    for r in resumed:
        assert r['step'] == list(range(1, STEPS + 1))
        assert r['loss'][:STEPS // 2] == straight[0]['loss'][:STEPS // 2]
        _close(r, straight[0], 'dp2xep2 resumed vs straight')
    assert straight[0]['loss'][0] - straight[0]['loss'][-1] > 0.5       # the loss moves far more than the tolerance
    np.testing.assert_allclose([r['gn'] for r in resumed], [r['gn'] for r in straight], rtol=1e-5)
    # a corrupt shard is named
    _mesh_half(tmp_path_factory, tmp_path / 'c'); f = tmp_path / 'c/ckpt/dcp/__1_0.distcp'; f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match='__1_0.distcp is missing, corrupt or truncated'): _run(tmp_path / 'c')

@pytest.mark.numerics
def test_single_process_checkpoint_resumes_on_the_mesh(tmp_path, tmp_path_factory):
    ref = _single(tmp_path_factory)
    _run(tmp_path, stop_after=STEPS // 2)                               # single-process checkpoint at half way
    assert (tmp_path / 'ckpt/optimizer.pt').exists() and 'dcp' not in read_meta(tmp_path / 'ckpt')
    for r in spawn_local(_worker, 4, str(tmp_path), None, 123, DP2EP2): _close(r, ref, 'single -> dp2xep2')

@pytest.mark.numerics
def test_mesh_checkpoint_resumes_in_one_process(tmp_path, tmp_path_factory):
    "Its optimizer state read whole from dcp/."
    ref = _single(tmp_path_factory); _mesh_half(tmp_path_factory, tmp_path)
    _close(_run(tmp_path, seed=123), ref, 'dp2xep2 -> single')

# (on ATen's portable kernels, numerics: the layout that shards most ways, cp2xep2; the others only regroup ranks)
@pytest.mark.parametrize('par', [dict(dp=4), pytest.param(dict(cp=2, ep=2), marks=pytest.mark.numerics), dict(dp=2, tp=2)],
                         ids=['dp4', 'cp2xep2', 'dp2xtp2'])
def test_mesh_checkpoint_resumes_on_another_mesh(par, tmp_path, tmp_path_factory):
    ref = _single(tmp_path_factory); _mesh_half(tmp_path_factory, tmp_path)
    for r in spawn_local(_worker, 4, str(tmp_path), None, 123, par): _close(r, ref, f'dp2xep2 -> {par}')
    # the final checkpoint, written by this mesh: its DCP shards put together are the consolidated weights, bit for bit
    w, (m, _) = read_dcp(tmp_path / 'ckpt/dcp'), load_model(tmp_path / 'ckpt')
    assert read_meta(tmp_path / 'ckpt')['train_config']['parallel'] == {'dp': 1, 'ep': 1, 'tp': 1, 'cp': 1, **par}
    assert set(w) == {n for n, _ in m.named_parameters()} and all(torch.equal(w[n], p) for n, p in m.named_parameters())
