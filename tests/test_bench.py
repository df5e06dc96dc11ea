"Benchmark: unbiased pass@k, per-task/overall summaries, the frozen set, and the `bench` stage end to end (oracle 100 %, null 0 %)."
import dataclasses, json, math, os, statistics
from itertools import combinations
from pathlib import Path

import pytest, yaml

from conftest import TOY_ORIG, toy_task
from composer2 import bench as B, tasks as T
from composer2.stages import bench as SB
from composer2.config import ConfigError


def brute_pass_at_k(n, c, k):
    "Fraction of all k-subsets of n samples (c correct) holding at least one correct sample."
    samples = [1] * c + [0] * (n - c)
    subs = list(combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subs) / len(subs)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert math.isclose(B.pass_at_k(n, c, k), brute_pass_at_k(n, c, k), abs_tol=1e-12), (n, c, k)
    assert B.pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for bad in [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)]:
        with pytest.raises(ValueError, match='pass@k'): B.pass_at_k(*bad)


def ep(task, resolved, cat='debug', **kw):
    d = dict(task_id=task, category=cat, resolved=resolved, reward=float(resolved), changed_lines=4, ruff_introduced=0,
             tool_calls=3, tokens_generated=100, tokens_context=900, wall_time=2.0, error='')
    d.update(kw); return d


def test_summarize_per_task_overall_and_by_category():
    eps = [ep('a', True), ep('a', False), ep('a', True), ep('b', False, 'docs', changed_lines=10), ep('b', False, 'docs'),
           ep('b', False, 'docs', error='boom')]
    s = B.summarize(eps, ks=(1, 2))
    a, b = s['per_task']['a'], s['per_task']['b']
    assert a['n'] == 3 and a['resolved'] == pytest.approx(2 / 3) and a['pass@2'] == pytest.approx(brute_pass_at_k(3, 2, 2))
    assert b['resolved'] == 0 and b['pass@1'] == 0 and b['changed_lines'] == pytest.approx(6) and b['errors'] == ['boom']
    assert s['n_tasks'] == 2 and s['resolved'] == pytest.approx((2 / 3 + 0) / 2)
    assert s['pass@1'] == pytest.approx(statistics.mean([a['pass@1'], b['pass@1']]))
    assert s['by_category'] == {'debug': pytest.approx(2 / 3), 'docs': 0.0}
    assert s['tool_calls'] == 3 and s['tokens_context'] == 900


def test_set_stats_against_direct_computation():
    ts = [toy_task(id='t1'), toy_task(id='t2', category='docs', prompt='x' * 500),
          toy_task(id='t3', category='devops', solution={'toymod.py': TOY_ORIG + '# more\n' * 9})]
    s = T.set_stats(ts)
    assert s['n_tasks'] == 3 and s['median_prompt_chars'] == statistics.median(len(t.prompt) for t in ts)
    lines = sorted(sum(1 for l in t.gold_patch.splitlines() if l[:1] in '+-' and l[:3] not in ('+++', '---')) for t in ts)
    assert s['median_gold_changed_lines'] == lines[1] == 2
    assert s['categories'] == {'debug': 1, 'feature': 0, 'refactor': 0, 'docs': 1, 'tests': 0, 'devops': 1}


def freeze(root: Path, tasks, name='ToyBench', version='v0'):
    d = root / 'data' / 'tasks'
    sha = T.save_tasks(tasks, d / f'{name}-{version}.jsonl')
    (d / 'manifest.json').write_text(json.dumps({'name': name, 'version': version, 'file': f'{name}-{version}.jsonl', 'sha256': sha}))
    return d


def test_load_frozen_refuses_changed_or_wrong_sets(tmp_path):
    with pytest.raises(T.TaskError, match='no manifest'): B.load_frozen(tmp_path, 'ToyBench', 'v0')
    d = freeze(tmp_path, [toy_task()])
    ts, man = B.load_frozen(d, 'ToyBench', 'v0')
    assert ts == [toy_task()] and man['version'] == 'v0'
    with pytest.raises(T.TaskError, match='holds ToyBench-v0'): B.load_frozen(d, 'ToyBench', 'v1')
    f = d / 'ToyBench-v0.jsonl'; f.write_text(f.read_text().replace('sign', 'sigm'))
    with pytest.raises(T.TaskError, match='changed after it was frozen'): B.load_frozen(d, 'ToyBench', 'v0')


def test_bench_config_is_validated(tmp_path):
    p = tmp_path / 'params.yaml'
    for bad, msg in [({'agents': ['oracle', 'gpt']}, 'unknown'), ({'samples': 2, 'ks': [3]}, 'bench.ks'),
                     ({'agents': ['oracle', None]}, r'bench.agents\[1\]'), ({'samples': 0}, 'bench.samples')]:
        p.write_text(yaml.safe_dump({'bench': bad}))
        with pytest.raises(ConfigError, match=msg): SB.run(str(p))


def run_stage(tmp_path, tasks, monkeypatch):
    freeze(tmp_path, tasks)
    (tmp_path / 'exclusions.json').write_text(json.dumps({'stdlib_dir': '/', 'reserved_modules': ['toymod'], 'files': []}))
    (tmp_path / 'params.yaml').write_text(yaml.safe_dump({'bench': {
        'name': 'ToyBench', 'version': 'v0', 'agents': ['oracle', 'null', 'heuristic'], 'samples': 2, 'ks': [1, 2],
        'workers': 2, 'quality': True, 'exclusions': 'exclusions.json'}}))
    monkeypatch.chdir(tmp_path)
    return SB.run('params.yaml')


@pytest.mark.slow
def test_bench_stage_oracle_resolves_all_null_none(tmp_path, monkeypatch, validated_toy):
    docs = dataclasses.replace(validated_toy, id='toy-docs', category='docs')
    m = run_stage(tmp_path, [validated_toy, docs], monkeypatch)
    assert m['oracle']['resolved'] == 1.0 and m['null']['resolved'] == 0.0 and m['harness_ok']
    assert m['sandbox']['backend'] in ('overlay', 'copy') and m['sandbox']['hides_original_sources']
    assert m['oracle']['pass@2'] == 1.0 and m['oracle']['changed_lines'] == 2 and m['oracle']['ruff_introduced'] == 0
    # the toy bug is an inverted condition: the scripted agent reverts it where the task is labelled debug, and only there
    assert m['heuristic']['by_category'] == {'debug': 1.0, 'docs': 0.0}
    assert m['null']['tool_calls'] == 1 and m['oracle']['tool_calls'] == 2 and m['oracle']['tokens_generated'] > 0
    s = m['set']
    assert s['n_tasks'] == 2 and s['categories']['debug'] == 1 and s['categories']['docs'] == 1
    assert s['median_gold_changed_lines'] == 2 and s['median_prompt_chars'] == len(validated_toy.prompt)
    on_disk = json.loads((tmp_path / 'reports' / 'metrics' / 'bench.json').read_text())
    assert on_disk['oracle']['resolved'] == 1.0 and on_disk['null']['resolved'] == 0.0 and on_disk['set']['n_tasks'] == 2
    per = json.loads((tmp_path / 'data' / 'bench' / 'per_task.json').read_text())
    assert set(per['oracle']) == {'toy', 'toy-docs'} and per['oracle']['toy']['n'] == 2
    eps = [json.loads(l) for l in (tmp_path / 'data' / 'bench' / 'oracle.jsonl').read_text().splitlines()]
    assert len(eps) == 4 and all(e['resolved'] for e in eps)


@pytest.mark.slow
def test_bench_stage_fails_loudly_when_the_oracle_cannot_resolve(tmp_path, monkeypatch, validated_toy):
    # a task whose gold patch does not fix it: the harness check must fail (and still write the metrics)
    wrong = dataclasses.replace(validated_toy, id='toy-wrong', solution={'toymod.py': validated_toy.files['toymod.py']})
    with pytest.raises(T.TaskError, match='harness check failed: oracle resolved 0.5'):
        run_stage(tmp_path, [validated_toy, wrong], monkeypatch)
    m = json.loads((tmp_path / 'reports' / 'metrics' / 'bench.json').read_text())
    assert not m['harness_ok'] and m['oracle']['resolved'] == 0.5 and m['null']['resolved'] == 0.0
