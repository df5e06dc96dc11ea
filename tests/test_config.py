"Configuration: strict typed loading, clear errors for bad params, profiles that only change existing keys."
import subprocess, sys
import pytest, yaml
from conftest import ROOT, BIN
from composer2.config import ConfigError, deep_merge, from_dict, load_section, read_yaml
from composer2.data import DataConfig
from composer2.model import ModelConfig
from composer2.pretrain import PretrainConfig
from composer2.sft import SFTConfig
from composer2.evaluate import EvalConfig
from composer2.tokenizer import TokenizerConfig
from composer2.pretrain_cp import CPPretrainConfig
from composer2.mtp import MTPStageConfig
from composer2.stages.lowp import LowpStageConfig
from composer2.tasks import TasksConfig
from composer2.bench import BenchConfig
from composer2.curriculum import AgentSFTConfig
from composer2.rl import RLStageConfig
from composer2.rl_eval import EvalRLConfig
from composer2.stages.export_hf import ExportHFConfig
from composer2.tasks_v2 import TasksV2Config
from composer2.stages.studies import StudiesConfig
from composer2.stages.study_bench import StudyBenchConfig
from composer2.stages.bench import BenchV2Config

# Every params.yaml section and the dataclass its stage loads it with (long_context may carry cp_size).
SECTIONS = {'data': DataConfig, 'tokenizer': TokenizerConfig, 'model': ModelConfig, 'base': PretrainConfig,
            'cpt': PretrainConfig, 'long_context': CPPretrainConfig, 'sft': SFTConfig, 'eval': EvalConfig,
            'mtp': MTPStageConfig, 'lowp': LowpStageConfig, 'tasks': TasksConfig, 'bench': BenchConfig,
            'agent_sft': AgentSFTConfig, 'rl': RLStageConfig, 'eval_rl': EvalRLConfig,
            'export_hf': ExportHFConfig, 'tasks_v2': TasksV2Config, 'bench_v2': BenchV2Config,
            'studies': StudiesConfig, 'study_bench': StudyBenchConfig}

def test_every_section_has_a_config():
    assert set(read_yaml(ROOT / 'params.yaml')) == set(SECTIONS)

@pytest.mark.parametrize('profile', ['default', 'smoke', 'gpu'])
def test_every_profile_validates(profile):
    p = read_yaml(ROOT / 'params.yaml')
    if profile != 'default': p = deep_merge(p, read_yaml(ROOT / 'profiles' / f'{profile}.yaml'))
    for name, cls in SECTIONS.items(): from_dict(cls, p[name], name)

def write_params(tmp_path, mutate):
    p = read_yaml(ROOT / 'params.yaml'); mutate(p)
    f = tmp_path / 'params.yaml'; f.write_text(yaml.safe_dump(p)); return f

def test_mistyped_key_is_named(tmp_path):
    f = write_params(tmp_path, lambda p: p['base']['train'].update(stpes=3))
    with pytest.raises(ConfigError, match=r"base\.train: unknown key 'stpes' \(did you mean 'steps'\?\)"):
        load_section(PretrainConfig, 'base', f)

def test_wrong_type_and_range(tmp_path):
    f = write_params(tmp_path, lambda p: p['model'].update(n_heads='four'))
    with pytest.raises(ConfigError, match=r"model\.n_heads: expected an integer"): load_section(ModelConfig, 'model', f)
    f = write_params(tmp_path, lambda p: p['model'].update(top_k=9))
    with pytest.raises(ConfigError, match='top_k'): load_section(ModelConfig, 'model', f)

def test_cli_reports_bad_params_without_traceback(tmp_path):
    f = write_params(tmp_path, lambda p: p['data'].update(code_dirs=['/definitely/missing/dir']))
    r = subprocess.run([str(BIN / 'composer2'), 'stage', 'data', '--params', str(f)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "code directory '/definitely/missing/dir' does not exist" in r.stderr
    assert 'Traceback' not in r.stderr
    f = write_params(tmp_path, lambda p: p['tokenizer'].update(vocab_sise=10))
    r = subprocess.run([str(BIN / 'composer2'), 'stage', 'tokenizer', '--params', str(f)], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 2 and "did you mean 'vocab_size'" in r.stderr

def test_missing_section_and_file(tmp_path):
    with pytest.raises(ConfigError, match='parameters file not found'): load_section(DataConfig, 'data', tmp_path / 'nope.yaml')
    (tmp_path / 'p.yaml').write_text('data: {}\n')
    with pytest.raises(ConfigError, match="missing section 'cpt'"): load_section(PretrainConfig, 'cpt', tmp_path / 'p.yaml')

def test_profile_overlay_cannot_invent_keys():
    with pytest.raises(ConfigError, match="'base.train.stepz'"):
        deep_merge(read_yaml(ROOT / 'params.yaml'), {'base': {'train': {'stepz': 1}}})
