import math

import pytest

from composer2.chat import ToolCall
from composer2.config import ConfigError
from composer2.rewards import (RewardConfig, communication_penalty, final_message, hygiene_counts, length_penalty,
                               stub_lines, total_reward)


def call(name, **a): return ToolCall(name, a).render()


@pytest.mark.parametrize('shape', ['log', 'power'])
def test_length_penalty_is_increasing_and_concave(shape):
    cfg = RewardConfig(length_shape=shape, length_scale=0.2, length_ref=100, length_power=0.5)
    xs = list(range(0, 5000, 7))
    p = [length_penalty(x, cfg) for x in xs]
    d = [b - a for a, b in zip(p, p[1:])]
    assert p[0] == 0 and all(v > 0 for v in d)                  # strictly increasing
    assert all(b < a for a, b in zip(d, d[1:]))                  # marginal penalty strictly falls (concave)
    assert abs(length_penalty(100, cfg) - 0.2) < 1e-12            # equals the scale at the reference length
    # midpoint concavity on random pairs
    for a, b in [(0, 1000), (37, 411), (5, 4999)]:
        assert length_penalty((a + b) / 2, cfg) > (length_penalty(a, cfg) + length_penalty(b, cfg)) / 2


def test_length_penalty_hand_values():
    assert math.isclose(length_penalty(256 * 3, RewardConfig(length_shape='log', length_scale=0.1, length_ref=256)), 0.2)
    assert math.isclose(length_penalty(400, RewardConfig(length_shape='power', length_scale=0.1, length_ref=100, length_power=0.5)), 0.2)
    with pytest.raises(ValueError): length_penalty(-1)


def test_config_is_validated():
    with pytest.raises(ConfigError, match='length_power'): RewardConfig(length_shape='power', length_power=1.5)
    with pytest.raises(ConfigError, match='length_shape'): RewardConfig(length_shape='linear')
    with pytest.raises(ConfigError, match='stub_weight'): RewardConfig(stub_weight=-1)


def test_hygiene_counts():
    texts = [call('grep', pattern='x'), call('grep', pattern='x'), call('grep', pattern='y'),
             '<|tool_call|>{"name": "grep"}<|/tool_call|>',               # missing required argument
             '<|tool_call|>not json<|/tool_call|>', 'just talking', call('teleport', to='mars'),
             '<|tool_call|>{"name": "read_file", "arguments": {"path": "a"}}']  # never closed
    h = hygiene_counts(texts)
    assert h == {'malformed': 5, 'repeated': 1, 'calls': 5}


def test_stub_lines_only_counts_added_lines():
    before = {'a.py': 'def f():\n    pass  # TODO old\n'}
    after = {'a.py': 'def f():\n    pass  # TODO old\n\n\ndef g():\n    ...\n\n\ndef h():\n    return 1  # FIXME\n', 'b.py': 'x = 1\n'}
    assert stub_lines(before, after) == 2
    assert stub_lines(before, before) == 0


def test_communication():
    assert final_message([call('submit', message='first'), call('submit', message='Second one.')]) == 'Second one.'
    assert final_message([call('submit')]) == ''
    assert communication_penalty('', 10) == 1 and communication_penalty('a b c', 10) == 0
    assert communication_penalty(' '.join('w' * 15), 10) == 0.5


def test_total_reward_hand_computed():
    cfg = RewardConfig(length_shape='log', length_scale=0.1, length_ref=100, malformed_weight=0.2, repeat_weight=0.05,
                       stub_weight=0.3, comm_weight=0.04, comm_max_words=4, style_weight=0.5)
    before = {'m.py': 'def f(x):\n    return x\n'}
    after = {'m.py': 'def f(x):\n    return x  # TODO\n'}
    texts = [call('read_file', path='m.py'), call('read_file', path='m.py'), 'hmm',
             call('submit', message='one two three four five six')]
    r = total_reward(1.0, 300, texts, before, after, cfg, ruff_findings=2)
    assert math.isclose(r['length'], -0.1 * math.log2(4))
    assert r['task'] == 1 and r['malformed'] == -0.2 and r['repeated'] == -0.05 and r['stubs'] == -0.3
    assert math.isclose(r['communication'], -0.04 * 0.5) and r['style'] == -1.0
    assert math.isclose(r['total'], 1 - 0.2 - 0.2 - 0.05 - 0.3 - 0.02 - 1.0)
    assert r['counts']['ruff'] == 2 and r['counts']['final_message_words'] == 6


def test_style_component_runs_ruff():
    before = {'m.py': 'def f(x):\n    return x\n'}
    after = {'m.py': 'import os\ndef f(x):\n    return x\n'}           # unused import: F401
    r = total_reward(0.0, 10, [call('submit', message='ok')], before, after, RewardConfig(style_weight=0.1))
    assert r['counts']['ruff'] >= 1 and r['style'] <= -0.1


def test_no_valid_call_gives_zero_task_reward_and_no_error():
    r = total_reward(0.0, 64, ['garbage', ''], {}, {}, RewardConfig(style=False))
    assert r['task'] == 0 and r['counts']['malformed'] == 2 and r['counts']['calls'] == 0 and r['total'] < 0
