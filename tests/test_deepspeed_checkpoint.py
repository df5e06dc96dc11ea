"""DeepSpeed ZeRO 0-3 on 2 gloo processes: exact resume through DeepSpeed's own checkpoint, the whole weights in the
single-process format beside it, and the logged grad norm equal to the single-process one."""
import json, os, subprocess, textwrap
import numpy as np, pytest, torch
from conftest import ROOT, BIN, tiny_cfg
from composer2.model import Transformer
from composer2.train import CheckpointError, TrainConfig, WindowSampler, load_model, read_meta, train

STREAM = (np.arange(3000) * 7 % 97).astype(np.uint16)
STEPS = 4
def _tc(**kw): return TrainConfig(steps=STEPS, batch_size=4, micro_batch_size=1, seq_len=16, lr=5e-3, warmup_steps=1,
                                  eval_every=10 ** 6, **kw)

WORKER = textwrap.dedent('''
    import json, os, sys, numpy as np, torch
    sys.path.insert(0, {tests!r})
    from conftest import tiny_cfg
    from composer2.model import Transformer
    from composer2.train import TrainConfig, WindowSampler, train
    from test_deepspeed_checkpoint import STREAM, _tc
    torch.set_num_threads(1)
    out, res = {{}}, sys.argv[1]
    for name, stop, seed in [('a', None, 0), ('b', {half}, 0), ('b', None, 123)]:   # straight; half; resumed (another init)
        torch.manual_seed(seed); m = Transformer(tiny_cfg(n_shared_experts=0, aux_loss_coef=0.0))
        h = train(m, _tc(zero_stage={zero}), WindowSampler(STREAM, 16, 4, seed=3), os.path.join(res, name), stage='ds', stop_after=stop)
        out[name + str(stop)] = dict(loss=h['loss'], gn=h['grad_norm'], step=h['step'])
    if torch.distributed.get_rank() == 0: open(os.path.join(res, 'out.json'), 'w').write(json.dumps(out))
''')

_SINGLE = {}
def _single(tmp_path_factory):
    if not _SINGLE:
        torch.manual_seed(0); m = Transformer(tiny_cfg(n_shared_experts=0, aux_loss_coef=0.0))
        h = train(m, _tc(), WindowSampler(STREAM, 16, 4, seed=3), tmp_path_factory.mktemp('single'), stage='ds')
        _SINGLE.update(h=h, w={n: p.detach().clone() for n, p in m.named_parameters()})
    return _SINGLE['h'], _SINGLE['w']

@pytest.mark.slow
# (on ATen's portable kernels, numerics: ZeRO 0 and 3, unsharded and fully sharded; 1 and 2 lie between)
@pytest.mark.parametrize('zero', [pytest.param(0, marks=pytest.mark.numerics), 1, 2, pytest.param(3, marks=pytest.mark.numerics)])
def test_deepspeed_resume_is_exact_and_writes_single_process_weights(tmp_path, tmp_path_factory, zero):
    w = tmp_path / 'worker.py'; w.write_text(WORKER.format(tests=str(ROOT / 'tests'), zero=zero, half=STEPS // 2))
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PATH': f"{BIN}:{os.environ['PATH']}", 'COMPOSER2_DEEPSPEED': '1'}
    r = subprocess.run([str(BIN / 'deepspeed'), '--no_local_rank', '--num_gpus', '2', '--master_port', str(29500 + os.getpid() % 1000),
                        str(w), str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads((tmp_path / 'out.json').read_text())
    straight, half, resumed = out['aNone'], out[f'b{STEPS // 2}'], out['bNone']
    assert resumed['step'] == list(range(1, STEPS + 1)) and resumed['loss'][:STEPS // 2] == half['loss']
    np.testing.assert_allclose(resumed['loss'], straight['loss'], rtol=1e-5)     # exact resume (asserted toleranced)
    np.testing.assert_allclose(resumed['gn'], straight['gn'], rtol=1e-5)
    meta = read_meta(tmp_path / 'b/ckpt')
    assert meta['step'] == STEPS and any(k.startswith('ds/ds/') for k in meta['deepspeed'])
    # the whole weights beside DeepSpeed's checkpoint, in the single-process format (ZeRO-3: gathered)
    ma, _ = load_model(tmp_path / 'a/ckpt'); mb, _ = load_model(tmp_path / 'b/ckpt')
    h, ws = _single(tmp_path_factory)
    big = max(p.abs().max().item() for p in ws.values())
    err_resume = max((p - dict(mb.named_parameters())[n]).abs().max().item() for n, p in ma.named_parameters()) / big
    err_single = max((p - ws[n]).abs().max().item() for n, p in ma.named_parameters()) / big
    # toleranced: two ranks, an all-reduce (and ZeRO's flat partitions) vs one process; the norm is the whole gradient's
    np.testing.assert_allclose(straight['loss'], h['loss'], rtol=1e-5)
    np.testing.assert_allclose(straight['gn'], h['grad_norm'], rtol=1e-5)
    lrel = max(abs(a - b) / b for a, b in zip(straight['loss'], h['loss']))
    grel = max(abs(a - b) / b for a, b in zip(straight['gn'], h['grad_norm']))
    print(f"zero {zero}: resumed vs straight weights {err_resume:.2e}; vs one process: loss {lrel:.2e}, grad norm {grel:.2e}, "
          f"weights {err_single:.2e}")
    assert err_resume < 1e-4 and err_single < 1e-4 and min(straight['gn']) > 0.1
    # a single process refuses to resume a DeepSpeed run it cannot continue, and says why
    spawn = tmp_path / 'c'; import shutil; shutil.copytree(tmp_path / 'b/ckpt', spawn / 'ckpt')
    m = json.loads((spawn / 'ckpt/meta.json').read_text()); m['step'] = 1; (spawn / 'ckpt/meta.json').write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match='written under DeepSpeed'):
        train(Transformer(tiny_cfg(n_shared_experts=0, aux_loss_coef=0.0)), _tc(), WindowSampler(STREAM, 16, 4, seed=3), spawn, stage='ds')
