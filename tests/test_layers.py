"""The package's structure, checked from the source: layers point one way, no import cycle, dvc.yaml lists each stage's
real code dependencies, notebooks stay readable. Each check is also run on a planted violation (a test of the test)."""
import json, shutil
from pathlib import Path
import pytest
from conftest import ROOT
from composer2.graph import dvc_deps, layer_violations, stage_code_deps, stage_table

def test_layers_point_one_way_and_no_cycles():
    assert layer_violations(ROOT / 'composer2') == []

@pytest.fixture
def pkg_copy(tmp_path):
    "A copy of the package and dvc.yaml to plant violations in."
    shutil.copytree(ROOT / 'composer2', tmp_path / 'composer2', ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copy(ROOT / 'dvc.yaml', tmp_path / 'dvc.yaml')
    for d in ['kernels', 'programs']:
        if (ROOT / d).exists(): shutil.copytree(ROOT / d, tmp_path / d)
    return tmp_path

def test_planted_upward_lazy_import_and_cycle_are_caught(pkg_copy):
    p = pkg_copy / 'composer2'
    with open(p / 'model.py', 'a') as f: f.write('\ndef _planted():\n    from composer2.rl import rollout_batch\n')
    with open(p / 'config.py', 'a') as f: f.write('\n_PLANTED = "composer2.cli:main"\n')       # an importlib string
    v = layer_violations(p)
    assert any(s.startswith('composer2/model.py:') and 'model (model) imports rl (rl), a higher layer (lazy import)' in s for s in v), v
    assert any('config (core) imports cli (cli), a higher layer (string import)' in s for s in v), v
    with open(p / 'io.py', 'a') as f: f.write('\nfrom composer2 import chat\n')
    with open(p / 'chat.py', 'a') as f: f.write('\ndef _planted():\n    import composer2.io\n')
    assert any(s.startswith('import cycle:') and 'chat' in s and 'io' in s for s in layer_violations(p))

def test_dvc_yaml_lists_every_file_each_stage_can_import():
    assert dvc_deps(ROOT / 'dvc.yaml') == {}
    table = stage_table(ROOT / 'composer2')
    assert set(table) >= {'data', 'tokenizer', 'base', 'cpt', 'long_context', 'sft', 'eval', 'mtp', 'lowp', 'tasks', 'bench',
                          'agent_sft', 'rl', 'eval_rl'}
    for name, spec in table.items():
        assert spec.startswith('composer2.stages.'), f"stage {name} lives outside composer2.stages: {spec}"

def test_planted_undeclared_import_fails_the_dvc_check(pkg_copy):
    deps = stage_code_deps('eval', pkg_copy / 'composer2')
    assert 'composer2/rl.py' not in deps
    mod = pkg_copy / Path(stage_table(pkg_copy / 'composer2')['eval'].split(':')[0].replace('.', '/') + '.py')
    with open(mod, 'a') as f: f.write('\ndef _planted():\n    import composer2.rl\n')
    d = dvc_deps(pkg_copy / 'dvc.yaml')
    assert 'composer2/rl.py' in d['eval']['missing'], d
    dvc_deps(pkg_copy / 'dvc.yaml', write=True)
    assert dvc_deps(pkg_copy / 'dvc.yaml') == {}

def test_studies_dvc_yaml_lists_its_code_deps_and_catches_a_planted_import(pkg_copy):
    assert dvc_deps(ROOT / 'studies' / 'dvc.yaml') == {}
    (pkg_copy / 'studies').mkdir(); shutil.copy(ROOT / 'studies' / 'dvc.yaml', pkg_copy / 'studies' / 'dvc.yaml')
    with open(pkg_copy / 'composer2' / 'stages' / 'studies.py', 'a') as f: f.write('\ndef _planted():\n    import composer2.serve\n')
    d = dvc_deps(pkg_copy / 'studies' / 'dvc.yaml')
    assert set(d) == {'study_tasks', 'study_rl', 'study_eval', 'study_summary'}    # a foreach stage is checked once, by its template
    assert all('composer2/serve.py' in v['missing'] for v in d.values()), d
    dvc_deps(pkg_copy / 'studies' / 'dvc.yaml', write=True)
    assert dvc_deps(pkg_copy / 'studies' / 'dvc.yaml') == {}

def _code_cells(nb):
    return [''.join(c['source']) for c in json.loads(nb.read_text())['cells'] if c['cell_type'] == 'code']

def test_notebooks_stay_readable():
    too_long, big_cells = [], []
    for nb in sorted((ROOT / 'nbs').rglob('*.ipynb')):
        cells = _code_cells(nb)
        n = sum(len(c.splitlines()) for c in cells)
        if n > 600: too_long.append(f'{nb.relative_to(ROOT)}: {n} lines of code')
        big_cells += [f'{nb.relative_to(ROOT)}: an exported cell of {len(c.splitlines())} lines' for c in cells
                      if '#| export' in c and len(c.splitlines()) > 80]
    assert not too_long and not big_cells, too_long + big_cells

def test_no_notebook_exports_the_package_when_run():
    # `make notebooks` runs the notebooks two at a time: a notebook ending in `nbdev_export()` rewrote every module of
    # composer2/ while the other imported it (CI failed with "cannot import name 'RLStageConfig' from composer2.rl").
    # Exporting is `make export`'s job, never a side effect of running a notebook.
    calls = [str(nb.relative_to(ROOT)) for nb in sorted((ROOT / 'nbs').rglob('*.ipynb'))
             if any('nbdev_export(' in c or 'nb_export(' in c for c in _code_cells(nb))]
    assert not calls, f'notebooks that export the package when run: {calls}'


def test_every_data_path_in_a_stages_own_params_is_a_dep_or_an_out():
    "A stage reads `data/...` files named in its own params section: each must be one of its deps or outs (or under one), so DVC runs the stage that makes it first."
    import re, yaml
    stages = yaml.safe_load((ROOT / 'dvc.yaml').read_text())['stages']; params = yaml.safe_load((ROOT / 'params.yaml').read_text())
    def strings(v):
        if isinstance(v, str): yield v
        for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else []): yield from strings(x)
    def names(items): return [next(iter(d)) if isinstance(d, dict) else str(d) for d in items or []]
    bad, checked = [], 0
    for name, st in stages.items():
        m = re.fullmatch(r'composer2 stage (\w+)', str(st.get('cmd', '')).strip())
        if not m or m.group(1) not in params: continue
        have = names(st.get('deps')) + names(st.get('outs'))
        for s in strings(params[m.group(1)]):
            if not s.startswith('data/'): continue
            checked += 1
            if not any(s == h or s.startswith(h.rstrip('/') + '/') for h in have): bad.append(f'{name}: {s}')
    assert checked > 20 and not bad, bad
