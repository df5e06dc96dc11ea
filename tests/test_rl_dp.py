"""The data-parallel RL trainer: several trainer ranks (gloo, spawned like torchrun's workers) step as one rank does,
with the Ray backend on a local Ray instance, and a failure of rank 0 stops the others."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

import composer2.rl as R
from composer2.config import to_dict
from composer2.parallel import spawn_local

# Tolerances: the 2-rank gradient is the 1-rank one summed in another order (each rank's micro-batches, then DDP's
# all-reduce), so gradients agree to fp32 rounding (rtol 1e-5); Adam's first update is ~lr·sign(g), so the weights
# after it agree to far below lr (atol 1e-7 at lr 1e-4). Losses and token counts are the same numbers (same
# micro-batches, reduced in the same order).
GRAD_RTOL, WEIGHT_ATOL = 1e-5, 1e-7


def _rc(**kw):
    return R.RolloutConfig(**{**dict(max_new_tokens=8, max_turns=2, context_budget=160, env_threads=1, dtype='float32'), **kw})


def _cfg(**kw):
    base = dict(n_train_tasks=12, steps=2, groups_per_step=2, group_size=2, max_staleness=1, n_workers=1, groups_per_batch=2,
                ckpt_every=0, mismatch_every=0, env_backend='local', rollout=_rc(), loss=R.LossConfig(micro_segments=2))
    return R.RLConfig(**{**base, **kw})


JOBS = {f'p{i:02d}': {'env': {'turns': 2}} for i in range(12)}


def _groups(n=3):
    tok, codec, model = R.tiny_setup(seed=0)
    spec = R.WorkerSpec(to_dict(model.cfg), tok.hf.to_str(), _rc(), R.toy_env_factory, 2, 1, 0)
    jobs = [{'env': {'turns': 2}, 'prompt_id': f'p{i}', 'group_id': i, 'group_size': 2} for i in range(n)]
    return [ts for _, ts in R.rollout_groups(model, codec, spec, jobs, None, 0, torch.Generator().manual_seed(0))[0]]


def _assert_first_update(groups, loss, weights, grads=None, stats=None):
    "One rank's first `Learner.step` on `groups` from `tiny_setup(0)` equals the given one (weights, gradient, stats)."
    model = R.tiny_setup(seed=0)[2]
    st = R.Learner(model, loss).step(groups)
    for k, v in model.state_dict().items(): torch.testing.assert_close(weights[k], v, rtol=0, atol=WEIGHT_ATOL)
    if grads is not None:
        assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
        for n, p in model.named_parameters():
            if p.grad is not None: torch.testing.assert_close(grads[n], p.grad, rtol=GRAD_RTOL, atol=1e-9)
    if stats is not None:
        assert stats['loss'] == st['loss'] and stats['tokens'] == st['tokens'] and stats['segments'] == st['segments']
        assert abs(stats['grad_norm'] - st['grad_norm']) <= GRAD_RTOL * st['grad_norm']


@pytest.mark.parametrize('kl_coef', [0.0, 0.1])
def test_data_parallel_step_equals_one_rank(kl_coef):
    groups = _groups()          # 6 segments, 2 per micro-batch: rank 0 takes micro-batches 0 and 2, rank 1 takes 1 (+ a zero-weighted repeat)
    loss = R.LossConfig(micro_segments=2, kl_coef=kl_coef)
    ranks = spawn_local(R.dp_step_check, 2, groups, loss)
    for k in ranks[0]['weights']: assert torch.equal(ranks[0]['weights'][k], ranks[1]['weights'][k])   # the ranks agree bit for bit
    for r in ranks: _assert_first_update(groups, loss, r['weights'], r['grads'], r['stats'])


def _rank_run(rank, world, out_dir, backend, steps=2):
    "One trainer rank of `run_rl` (rank 0 starts a local Ray instance for the Ray backend); records each rank's step-1 update."
    torch.set_num_threads(1)
    skip = None
    if backend == 'ray' and rank == 0:
        import ray
        try: ray.init(address='local', num_cpus=2, include_dashboard=False, log_to_driver=False)
        except Exception as e:  # an overloaded machine can time Ray's own node startup out: not this code's failure
            if 'timed out during startup' not in str(e): raise
            skip = str(e)
    box = [skip]; dist.broadcast_object_list(box); skip = box[0]
    if skip: return {'skip': skip}
    first, orig = {}, R.Learner.step
    def step(self, groups):
        st = orig(self, groups)
        if self.version == 1: first.update(groups=groups, stats=st, weights={k: v.clone() for k, v in self.model.state_dict().items()})
        return st
    R.Learner.step = step
    try:
        tok, _, model = R.tiny_setup(seed=0)
        hist = R.run_rl(_cfg(backend=backend, steps=steps, ckpt_every=1), model, tok.hf.to_str(), JOBS, R.toy_env_factory, out_dir)
    finally:
        R.Learner.step = orig
        if backend == 'ray' and rank == 0:
            import ray; ray.shutdown()
    return {'hist': hist, 'first': first, 'final': {k: v.clone() for k, v in model.state_dict().items()}}


def _same_groups(a, b) -> bool:
    return [[t.reward for t in g] for g in a] == [[t.reward for t in g] for g in b] and all(
        np.array_equal(getattr(sa, f), getattr(sb, f)) for ga, gb in zip(a, b) for ta, tb in zip(ga, gb)
        for sa, sb in zip(ta.segments, tb.segments, strict=True) for f in ('ids', 'mask', 'blogp', 'version', 'routes'))


def _check_two_rank_run(ranks, out_dir):
    h0, h1 = ranks[0]['hist'], ranks[1]['hist']
    assert len(h0['steps']) == 2 and h1 == h0            # rank 1 returns rank 0's history
    for k in ranks[0]['final']: assert torch.equal(ranks[0]['final'][k], ranks[1]['final'][k])   # one set of weights
    f0, f1 = ranks[0]['first'], ranks[1]['first']
    assert _same_groups(f0['groups'], f1['groups'])     # rank 1 stepped on rank 0's groups
    _assert_first_update(f0['groups'], R.LossConfig(micro_segments=2), f0['weights'], stats=f0['stats'])
    assert (out_dir / 'ckpt' / 'meta.json').exists()      # rank 0's final checkpoint


@pytest.mark.slow
@pytest.mark.real_spawn         # a Ray node started from a rank forked by the forkserver timed out starting (tests/conftest.py)
def test_two_trainer_ranks_with_ray_workers_train_and_first_update_equals_one_rank(tmp_path, ray_serial):
    pytest.importorskip('ray')
    ranks = spawn_local(_rank_run, 2, tmp_path, 'ray')
    if 'skip' in ranks[0]: pytest.skip(f"local Ray instance did not start: {ranks[0]['skip']}")
    _check_two_rank_run(ranks, tmp_path)
    assert sum(ranks[0]['hist']['staleness']) > 0         # asynchronous: the workers rolled out ahead of the trainer


def test_two_trainer_ranks_sync_backend(tmp_path):
    _check_two_rank_run(spawn_local(_rank_run, 2, tmp_path, 'sync'), tmp_path)


def test_two_trainer_ranks_resume_from_rank_0s_checkpoint(tmp_path):
    spawn_local(_rank_run, 2, tmp_path, 'sync', 1)
    ranks = spawn_local(_rank_run, 2, tmp_path, 'sync', 2)     # rank 0 resumes (weights, optimiser, sampler); rank 1 gets its state
    h0, h1 = ranks[0]['hist'], ranks[1]['hist']
    assert h0['resumed_from'] == 1 and len(h0['steps']) == 2 and h1 == h0
    for k in ranks[0]['final']: assert torch.equal(ranks[0]['final'][k], ranks[1]['final'][k])   # same Adam state: same step


def _failing_rank(rank, world):
    tok, _, model = R.tiny_setup(seed=0)
    try: R.run_rl(_cfg(backend='sync', adaptive_categories=True), model, tok.hf.to_str(), JOBS, R.toy_env_factory, '/nonexistent/x')
    except Exception as e: return f'{type(e).__name__}: {e}'


@pytest.mark.real_spawn         # the package's own start method (tests/conftest.py forks ranks elsewhere)
def test_a_failure_of_rank_0_stops_the_other_ranks():
    e0, e1 = spawn_local(_failing_rank, 2)
    assert e0.startswith('ConfigError') and 'adaptive_categories' in e0
    assert e1.startswith('RuntimeError: rl: trainer rank 0 failed (ConfigError') and 'rank 1 stops' in e1


class _ThreeHeads(torch.nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(2, 1) for _ in range(3))
    def forward(self, x, use): return sum(getattr(self, n)(x).sum() for n in use)


def _unused(rank, world):
    import contextlib
    from torch.nn.parallel import DistributedDataParallel
    m = _ThreeHeads(); d = DistributedDataParallel(m, find_unused_parameters=True)
    plan = [['a', 'b'], ['a']] if rank == 0 else [['a'], ['a']]     # b: rank 0's first (no_sync) micro-batch only; c: never
    for j, use in enumerate(plan):
        with d.no_sync() if j == 0 else contextlib.nullcontext(): d(torch.ones(1, 2), use).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in m.named_parameters()}


def test_ddp_reduces_what_one_rank_would_accumulate():
    """What `Learner.data_parallel` relies on for MoE: an expert used in one rank's no_sync micro-batch only still gets
    its gradient on every rank, and one used nowhere keeps no gradient (Adam skips it, as with one rank)."""
    for g in spawn_local(_unused, 2):
        assert g['a.bias'].item() == 2.0 and g['b.bias'].item() == 0.5      # DDP averages: (1 + 1 + 1 + 1) / 2, 1 / 2
        assert g['c.weight'] is None and g['c.bias'] is None
