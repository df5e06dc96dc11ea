"Agents and episodes: the interface, the oracle/null/heuristic agents, hidden-test isolation, quality measure."
import pytest

from composer2 import tasks as T
from composer2.agents import (NullAgent, OracleAgent, HeuristicAgent, ModelAgent, run_episode, call, ruff_introduced, make_agent)
from composer2.chat import Message, parse_assistant

from conftest import toy_task

SANDBOX, WHY = T.sandbox_available()
needs_sandbox = pytest.mark.skipif(not SANDBOX, reason=f'sandbox unavailable: {WHY}')

@pytest.fixture(scope='module')
def task(validated_toy):
    return validated_toy

def test_model_agent_renders_the_conversation():
    seen = []
    a = ModelAgent(lambda text: seen.append(text) or call('submit'))
    out = a.act([Message('system', 'sys'), Message('user', 'fix it')])
    assert parse_assistant(out).calls[0].name == 'submit'
    assert seen[0].startswith('<|bos|><|system|>sys<|end|><|user|>fix it<|end|>') and seen[0].endswith('<|assistant|>')
    with pytest.raises(ValueError, match='unknown agent'): make_agent('nope', [])

def test_ruff_introduced_counts_only_new_findings():
    assert ruff_introduced({'a.py': 'x = 1\n'}, {'a.py': 'import os\nimport sys\nx = 1\n'}) == 2
    assert ruff_introduced({'a.py': 'import os\n'}, {'a.py': 'import os\n', 'b.txt': 'x'}) == 0

@needs_sandbox
def test_oracle_null_heuristic_on_toy(task):
    o = run_episode(task, OracleAgent([task]))
    n = run_episode(task, NullAgent())
    h = run_episode(task, HeuristicAgent())
    assert o.resolved and o.reward == 1.0 and o.submitted and o.changed_lines == 2 and o.ruff_introduced == 0
    assert not n.resolved and n.reward == 0.0 and n.tool_calls == 1 and n.changed_lines == 0
    assert h.resolved and h.tool_calls >= 3
    assert o.tokens_generated > 0 and o.tokens_context > o.tokens_generated and o.wall_time > 0
    roles = [m.role for m in o.messages]
    assert roles[:2] == ['system', 'user'] and roles[2:4] == ['assistant', 'tool']

@needs_sandbox
def test_agent_never_sees_hidden_tests(task):
    seen = []
    class Snoop:
        name = 'snoop'
        def reset(self, t): self.n = 0
        def act(self, messages):
            self.n += 1
            if self.n == 1: return call('shell', cmd=f'ls -a; ls -a {T.HIDDEN} 2>&1; cat test_toy.py 2>&1; echo done')
            seen.append(messages[-1].content); return call('submit')
    r = run_episode(task, Snoop())
    assert 'done' in seen[0] and 'test_sign' not in seen[0] and T.HIDDEN not in r.diff and not r.resolved

@needs_sandbox
def test_malformed_and_silent_agents_end_cleanly(task):
    class Bad:
        name = 'bad'
        def reset(self, t): self.n = 0
        def act(self, messages):
            self.n += 1
            return '<|tool_call|>{not json<|/tool_call|>' if self.n == 1 else 'I am done.'
    r = run_episode(task, Bad())
    assert r.tool_calls == 1 and r.tool_errors == 1 and r.turns == 2 and not r.resolved and not r.submitted
    class Crash:
        name = 'crash'
        def reset(self, t): pass
        def act(self, messages): raise RuntimeError('model server down')
    r = run_episode(task, Crash())
    assert not r.resolved and 'model server down' in r.error
