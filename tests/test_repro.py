"""`composer2.repro`: the pipeline in two DVC lanes, on a small DVC project of its own (a few seconds of `dvc` calls).
The lanes must overlap in time, every stage must run once and leave `dvc status` clean, and a failing side stage
must fail the command, show its log and leave the main lane's finished work in place."""
import json, subprocess, sys, time
from pathlib import Path
import pytest
import yaml
from composer2.repro import _dvc, lanes, run_lanes, stage_graph

STAGE = ("import json, sys, time; from pathlib import Path; name, secs = sys.argv[1], float(sys.argv[2]); "
         "t0 = time.time(); time.sleep(secs); Path('out').mkdir(exist_ok=True); Path('out', name).write_text(name); "
         "Path('times').mkdir(exist_ok=True); Path('times', name + '.json').write_text(json.dumps([t0, time.time()]))")

def _project(tmp_path: Path, fail_side: bool = False) -> Path:
    "a -> (b -> c) main lane, a -> s side lane, r reads c and s; `fail_side`: stage s exits 3 after its sleep."
    (tmp_path / 'stage.py').write_text(STAGE + ("\nif name == 's': sys.exit(3)" if fail_side else ''))
    st = lambda name, secs, deps: {'cmd': f'{sys.executable} stage.py {name} {secs}', 'deps': ['stage.py', *deps],
                                   'outs': [f'out/{name}']}
    (tmp_path / 'dvc.yaml').write_text(yaml.safe_dump({'stages': {
        'a': st('a', 0, []), 'b': st('b', 1.5, ['out/a']), 'c': st('c', 1.5, ['out/b']),
        's': st('s', 2.5, ['out/a']), 'r': st('r', 0, ['out/c', 'out/s'])}}, sort_keys=False))
    subprocess.run([_dvc()[0], 'init', '--no-scm', '-q'], cwd=tmp_path, check=True)
    return tmp_path

def _times(p: Path) -> dict:
    return {f.stem: json.loads(f.read_text()) for f in (p / 'times').glob('*.json')}

def test_lanes_overlap_and_leave_the_pipeline_up_to_date(tmp_path):
    p = _project(tmp_path); said = []
    assert lanes(stage_graph(p / 'dvc.yaml'), ['s']) == {'first': ['a'], 'side': ['s'], 'main': ['b', 'c'], 'rest': ['r']}
    assert run_lanes(['s'], p / 'dvc.yaml', echo=said.append) == 0
    t = _times(p)
    assert set(t) == {'a', 'b', 'c', 's', 'r'}
    assert t['s'][0] < t['c'][1] and t['b'][0] < t['s'][1], t     # s ran while b and c ran
    assert t['a'][1] <= min(t['b'][0], t['s'][0]) and t['r'][0] >= max(t['c'][1], t['s'][1]), t
    lock = yaml.safe_load((p / 'dvc.lock').read_text())['stages']
    assert set(lock) == {'a', 'b', 'c', 's', 'r'}
    st = subprocess.run([*_dvc(), 'status', '--json'], cwd=p, capture_output=True, text=True, check=True)
    assert json.loads(st.stdout) == {}, st.stdout
    assert any("side lane ['s']" in s for s in said), said
    assert (p / '.dvc/tmp/repro-side.log').exists()
    for f in (p / 'times').glob('*.json'): f.unlink()
    assert run_lanes(['s'], p / 'dvc.yaml', echo=said.append) == 0 and _times(p) == {}   # up to date: nothing runs again

def test_a_failing_side_stage_fails_the_command_and_keeps_the_main_lanes_work(tmp_path):
    p = _project(tmp_path, fail_side=True); said = []
    rc = run_lanes(['s'], p / 'dvc.yaml', echo=said.append)
    assert rc != 0
    assert any('the side lane failed' in s and "'s'" in s for s in said), said     # the log's tail names the stage
    lock = yaml.safe_load((p / 'dvc.lock').read_text())['stages']
    assert {'a', 'b', 'c'} <= set(lock) and 's' not in lock and 'r' not in lock
    assert (p / 'out/c').read_text() == 'c' and not (p / 'out/r').exists()

def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(FileNotFoundError, match='does not exist'): run_lanes(['s'], tmp_path / 'dvc.yaml')
    p = _project(tmp_path)
    from composer2.config import ConfigError
    with pytest.raises(ConfigError, match=r"unknown side stage\(s\) \['x'\]"): run_lanes(['x'], p / 'dvc.yaml')
    assert not (p / 'times').exists()
    r = subprocess.run([sys.executable, '-m', 'composer2.repro', '--dvc-yaml', str(p / 'dvc.yaml'), '--side', 'x'],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown side stage(s) ['x']" in r.stderr

def test_a_workspace_whose_dvc_yaml_is_a_symlink_runs_in_the_workspace(tmp_path):
    "`make repro PROFILE=x` runs in runs/x, whose dvc.yaml links to the repository's: the lanes must run there, not at the link's target."
    (tmp_path / 'repo').mkdir(); src = _project(tmp_path / 'repo'); ws = tmp_path / 'ws'; ws.mkdir()
    for f in ['dvc.yaml', 'stage.py']: (ws / f).symlink_to(src / f)
    subprocess.run([_dvc()[0], 'init', '--no-scm', '-q'], cwd=ws, check=True)
    assert run_lanes(['s'], ws / 'dvc.yaml', echo=lambda s: None) == 0
    assert set(_times(ws)) == {'a', 'b', 'c', 's', 'r'} and not (src / 'out').exists() and not (src / 'dvc.lock').exists()
