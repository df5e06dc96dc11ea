"The lowp stage's arms trained side by side (spawned processes) give the same numbers as one after the other."
import json
import yaml
from test_lowp import _tiny_workspace


def test_lowp_arms_side_by_side_same_numbers(tmp_path, monkeypatch):
    from composer2.stages.lowp import run as stage
    _, sec = _tiny_workspace(tmp_path)
    monkeypatch.chdir(tmp_path)
    res = {}
    for w in (1, 2):
        (tmp_path / f'p{w}.yaml').write_text(yaml.safe_dump({'lowp': {**sec, 'workers': w, 'out_dir': str(tmp_path / f'out{w}')}}))
        res[w] = stage(f'p{w}.yaml')
    drop = ('wall_s', 'tokens_per_s')
    for arm in ('high', 'nvfp4_mxfp8'):
        a, b = ({k: v for k, v in res[w]['arms'][arm].items() if k not in drop} for w in (1, 2))
        assert a == b, arm            # same process-independent computation, same thread count: identical
    for w in (1, 2): assert (tmp_path / f'out{w}/nvfp4_mxfp8/ckpt/meta.json').exists()
