"The studies pipeline's summary on planted metric files: pooling only what ran, naming what did not, refusing mismatched tasks."
import json
import numpy as np
import pytest
from composer2.config import ConfigError
from composer2.stages.studies import StudiesConfig, _run_summary, pooled_difference

def _cfg(**kw):
    base = dict(runs={f'rl_s{i}': {'seed': i} for i in (1, 2, 3)} | {'off_s1': {'seed': 1, 'loss': {'router_replay': False}}},
                evaluate={'agent_sft': 'a', 'rl_s1': 'b', 'rl_s2': 'c', 'rl_s3': 'd'}, replication=['rl_s1', 'rl_s2', 'rl_s3'],
                ablations={'router_replay': {'replay': ['rl_s1', 'rl_s2'], 'no_replay': ['off_s1', 'off_s2']}})
    base['runs']['off_s2'] = {'seed': 2, 'loss': {'router_replay': False}}
    return StudiesConfig(**{**base, **kw})

def _plant(root, name, obj):
    p = root / 'reports' / 'metrics' / 'studies' / f'{name}.json'; p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj))

def _eval(per_task, tasks):
    return {'checkpoint': 'x', 'mean': float(np.mean(per_task)), 'stderr': 0.0, 'resolved': 0.0, 'gen_tokens_mean': 1.0,
            'k': len(per_task[0]), 'tasks': tasks, 'per_task': per_task}

def _rl(k3, replay=True):
    return {'overrides': {} if replay else {'loss': {'router_replay': False}}, 'reward_first_quarter': 0.3,
            'reward_last_quarter': 0.35, 'staleness_hist': [3, 1], 'throughput': {'wall_s': 10.0, 'samples_per_s': 2.0},
            'curve': [{'loss': 0.1, 'reward_mean': 0.3, 'gen_tokens_mean': 100.0}] * 4,
            'mismatch': [{'replay': {'k3': k3}, 'no_replay': {'k3': 3 * k3}}]}

def test_summary_pools_what_ran_and_names_what_did_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    g = np.random.default_rng(1); tasks = [f't{i}' for i in range(12)]
    ref = g.uniform(0, 1, (12, 4)).round(3).tolist()
    runs = {r: (np.array(ref) + d).tolist() for r, d in (('rl_s1', 0.05), ('rl_s2', 0.03))}
    _plant(tmp_path, 'eval_agent_sft', _eval(ref, tasks))
    for r, v in runs.items(): _plant(tmp_path, f'eval_{r}', _eval(v, tasks))
    _plant(tmp_path, 'rl_rl_s1', _rl(1e-5)); _plant(tmp_path, 'rl_off_s1', _rl(1e-5, replay=False))
    head = _run_summary(_cfg(), tmp_path, 0.0)
    det = json.loads((tmp_path / 'reports' / 'metrics' / 'studies_detail.json').read_text())
    assert det['replication']['missing'] == ['rl_s3'] and det['replication']['runs'] == ['rl_s1', 'rl_s2']
    want = pooled_difference(ref, list(runs.values()), 1)
    assert head['replication_k1']['diff'] == pytest.approx(0.04) == want['diff'] and head['replication_k1']['seeds'] == 2
    assert head['replication_k1']['per_seed'] == pytest.approx([0.05, 0.03])
    assert set(det['replication']['best_of_k']) == {'1', '2', '4'} and 'replication_k4' in head
    ab = det['ablations']['router_replay']['arms']
    assert ab['replay']['missing'] == ['rl_s2'] and ab['no_replay']['missing'] == ['off_s2']
    assert ab['no_replay']['mismatch_k3']['mean'] == pytest.approx(3e-5) and head['router_replay']['replay']['seeds'] == 1
    assert json.loads((tmp_path / 'reports' / 'metrics' / 'studies.json').read_text())['test_seed'] == 11

def test_summary_refuses_scores_on_other_tasks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _plant(tmp_path, 'eval_agent_sft', _eval([[0.1, 0.2]] * 3, ['a', 'b', 'c']))
    _plant(tmp_path, 'eval_rl_s1', _eval([[0.1, 0.2]] * 3, ['a', 'b', 'd']))
    with pytest.raises(ConfigError, match='eval_rl_s1 scored other tasks than eval_agent_sft'): _run_summary(_cfg(), tmp_path, 0.0)

def test_nothing_run_yet_gives_a_headline_without_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    head = _run_summary(_cfg(), tmp_path, 0.0)
    assert 'replication_k1' not in head and head['router_replay']['replay']['seeds'] == 0
