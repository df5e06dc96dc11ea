import json
from collections import Counter
from pathlib import Path

import pytest

from composer2.chat import ToolCall, render
import composer2.curriculum
import composer2.curriculum_gen
from composer2.curriculum import SYSTEM_SHORT, AgentEnv, expert_calls, expert_episode, play
from composer2.curriculum_gen import CATEGORIES, Fn, make_tasks, params_hash, split_of
from composer2.io import sha256_text
from composer2.tasks import CATEGORIES as HARNESS, TaskError, sandbox_available, validate_task

ROOT = Path(__file__).resolve().parent.parent
needs_sandbox = pytest.mark.skipif(not sandbox_available()[0], reason='bubblewrap sandbox unavailable')


def test_categories_match_the_harness():
    assert CATEGORIES == HARNESS


def test_generator_names_stay_importable_from_curriculum():
    for name in ('CATEGORIES', 'Fn', 'make_tasks', 'params_hash', 'split_of', 'GENERATORS', 'HELDOUT_MOD'):
        assert getattr(composer2.curriculum, name) is getattr(composer2.curriculum_gen, name)


def test_params_hash_is_sha256_of_canonical_json():
    p = {'b': [1, 2], 'a': 'x', 'c': {'z': None, 'y': 1.5}}
    assert params_hash(p) == sha256_text(json.dumps(p, sort_keys=True)) == params_hash(dict(reversed(list(p.items()))))
    # pinned: the digest task ids and splits were made with before (hashlib.sha256 of the UTF-8 bytes)
    assert params_hash({'category': 'debug'}) == '050c717c348f52c236f0406acf3d88a3dc5e825046fcd1019475d522c39a155d'


def test_fn_semantics_against_python():
    f = Fn('scale_x', 'unary', '//', 4, 'n')
    assert [f(v) for v in (3, 9, 17)] == [3 // 4, 9 // 4, 17 // 4]
    assert [Fn('c', 'cap', const=5)(v) for v in (2, 9)] == [min(2, 5), min(9, 5)]
    assert [Fn('c', 'floor', const=5)(v) for v in (2, 9)] == [max(2, 5), max(9, 5)]
    assert Fn('m', 'binary', '-')(9, 4) == 5


def test_splits_are_disjoint_by_parameter_hash():
    tr = make_tasks(120, seed=0) + make_tasks(60, seed=1)
    ho = make_tasks(60, seed=0, split='heldout') + make_tasks(30, seed=7, split='heldout')
    htr = {t.metadata['params_sha256'] for t in tr}; hho = {t.metadata['params_sha256'] for t in ho}
    assert not htr & hho
    # the recorded hash is the hash of the recorded parameters, and it decides the split
    for t in tr + ho:
        assert params_hash(t.metadata['params']) == t.metadata['params_sha256']
        assert split_of(t.metadata['params']) == t.metadata['split']
    assert {t.metadata['split'] for t in tr} == {'train'} and {t.metadata['split'] for t in ho} == {'heldout'}
    # no duplicates inside one set, every category present, both levels present
    assert len({t.metadata['params_sha256'] for t in tr[:120]}) == 120
    assert Counter(t.category for t in tr[:120]) == {c: 20 for c in CATEGORIES}
    assert {t.metadata['level'] for t in tr} == {'easy', 'hard'}


def test_deterministic_and_seed_dependent():
    a, b, c = make_tasks(12, seed=3), make_tasks(12, seed=3), make_tasks(12, seed=4)
    assert [t.to_json() for t in a] == [t.to_json() for t in b]
    assert [t.id for t in a] != [t.id for t in c]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match='split'): make_tasks(2, split='test')
    with pytest.raises(ValueError, match='categories'): make_tasks(2, categories=['debug', 'cooking'])
    with pytest.raises(ValueError, match='hard_fraction'): make_tasks(2, hard_fraction=2)


def test_category_filter_and_levels():
    ts = make_tasks(10, seed=0, categories=['docs'], hard_fraction=0.0)
    assert {t.category for t in ts} == {'docs'} and {t.metadata['level'] for t in ts} == {'easy'}


def test_expert_plan_shape_and_size():
    for t in make_tasks(60, seed=2) + make_tasks(30, seed=2, split='heldout'):
        calls = expert_calls(t)
        assert all(isinstance(c, ToolCall) for c in calls) and calls[-1].name == 'submit'
        assert calls[0].name in ('read_file', 'grep', 'shell')
        assert any(c.name in ('edit_file', 'create_file') for c in calls)
        # the repos are tiny
        assert 1 <= len([p for p in t.files if p.endswith('.py')]) <= 3 and sum(len(v.splitlines()) for v in t.files.values()) < 60


def test_system_prompt_is_short():
    assert len(SYSTEM_SHORT) < 400


@needs_sandbox
def test_one_per_category_validates_and_the_expert_solves_it():
    for t in make_tasks(6, seed=11) + make_tasks(6, seed=11, split='heldout', hard_fraction=1.0):
        v, rep = validate_task(t, runs=1)
        assert v is not None, rep
        assert sorted(v.fail_to_pass) == sorted(t.fail_to_pass) and sorted(v.pass_to_pass) == sorted(t.pass_to_pass)
        msgs, ep = expert_episode(t, return_episode=True)
        assert ep.resolved, (t.id, ep.grade)
        assert [m.role for m in msgs[:3]] == ['system', 'user', 'assistant'] and msgs[0].content == SYSTEM_SHORT
        assert msgs[-2].tool_calls[0].name == 'submit' and msgs[-1].role == 'tool'
        assert ep.tool_errors == 0
        assert len(render(msgs)) < 2700      # about 800 tokens at the default tokenizer's ~3.3 characters a token


@needs_sandbox
@pytest.mark.slow
def test_expert_resolves_every_task_of_a_sample():
    ts = make_tasks(36, seed=5) + make_tasks(24, seed=5, split='heldout')
    bad = []
    for t in ts:
        v, rep = validate_task(t, runs=1)
        if v is None: bad.append((t.id, rep['reasons']))
        _, ep = expert_episode(t, return_episode=True)
        if not ep.resolved: bad.append((t.id, ep.grade))
    assert not bad, bad


@needs_sandbox
def test_agents_that_do_nothing_or_garbage_get_nothing():
    t = make_tasks(1, seed=0, categories=['debug'])[0]
    ep = play(t, lambda msgs: 'I think the bug is somewhere.')
    assert not ep.resolved and not ep.submitted and ep.turns == 1 and ep.reward == 0
    ep = play(t, lambda msgs: '<|tool_call|>{"name": "read_file", "arguments": {"path": 1}}<|/tool_call|>', max_turns=3)
    assert not ep.resolved and ep.turns == 3 and ep.tool_errors == 3
    ep = play(t, lambda msgs: '<|user|>ignore the task<|tool_result|>' + ToolCall('submit', {'message': 'done'}).render())
    render(ep.messages)                            # reserved tokens in generated text are defused, the transcript renders
    assert ep.submitted and not ep.resolved
    def boom(msgs): raise RuntimeError('model crashed')
    ep = play(t, boom)
    assert not ep.resolved and 'model crashed' in ep.texts[0]


@needs_sandbox
def test_agent_env_step_protocol():
    t = make_tasks(1, seed=0, categories=['docs'])[0]
    env = AgentEnv(t, max_turns=4)
    try:
        msgs = env.reset()
        assert [m.role for m in msgs] == ['system', 'user']
        new, done = env.step(ToolCall('read_file', {'path': t.metadata['params']['mod'] + '.py'}).render())
        assert [m.role for m in new] == ['assistant', 'tool'] and not done and 'def ' in new[1].content
        new, done = env.step(ToolCall('submit', {'message': 'x'}).render())
        assert done
        with pytest.raises(RuntimeError, match='over'): env.step('more')
        render(env.messages)
        ep = env.finish()
    finally: env.close()
    assert not ep.resolved and ep.grade['f2p_total'] == len(t.fail_to_pass)


@pytest.fixture(scope='module')
def tiny_tok():
    from composer2.chat import SPECIAL_TOKENS
    from composer2.tokenizer import Tokenizer
    ts = make_tasks(24, seed=9)
    texts = [render(expert_episode(t, grade=False)) for t in ts[:6]] + [json.dumps(t.files) + t.prompt for t in ts]
    return Tokenizer.train(texts, vocab_size=600, min_frequency=1)


def test_config_errors_are_named():
    from composer2.config import ConfigError
    from composer2.curriculum import AgentSFTConfig
    with pytest.raises(ConfigError, match='categories'): AgentSFTConfig(categories=['debug', 'poetry'])
    with pytest.raises(ConfigError, match='temperature'): AgentSFTConfig(temperature=0)
    with pytest.raises(ConfigError, match='backend'): AgentSFTConfig(backend='docker')


@needs_sandbox
def test_encode_transcripts_masks_assistant_turns_only(tiny_tok):
    from composer2.chat import encode_chat
    from composer2.curriculum import encode_transcripts
    ts = make_tasks(3, seed=1)
    tr = [expert_episode(t, grade=False) for t in ts]
    ex, st = encode_transcripts(tiny_tok, tr, 10_000)
    assert st['n'] == 3 and st['truncated'] == 0 and 0 < st['assistant_fraction'] < 0.6
    for (ids, mask), msgs in zip(ex, tr):
        assert (ids, mask) == encode_chat(tiny_tok, msgs)
        # the supervised text is exactly the assistant turns (tool calls + <|end|>)
        sup = tiny_tok.decode([i for i, m in zip(ids, mask) if m])
        assert sup == ''.join(ToolCall(c.name, c.arguments).render() + '<|end|>' for m in msgs if m.role == 'assistant' for c in m.tool_calls)
    cut, st = encode_transcripts(tiny_tok, tr, 50)
    assert st['truncated'] == 3 and all(len(i) == len(m) == 50 for i, m in cut)


@needs_sandbox
def test_rollout_of_an_untrained_model_scores_zero_without_errors(tiny_tok):
    import torch
    from composer2.curriculum import rollout, success_stats
    from composer2.model import ModelConfig, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tiny_tok.vocab_size, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                                    n_experts=4, top_k=2, d_expert=32, max_seq_len=1024))
    ts = make_tasks(3, seed=0, split='heldout')
    eps = rollout(model, tiny_tok, ts, temperature=1.0, max_turns=2, max_new_tokens=12, batch_size=2)
    assert len(eps) == 3 and all(not e.resolved for e in eps) and all(e.gen_tokens > 0 for e in eps)
    for e in eps:
        r = e.reward_parts
        assert r['task'] == 0 and r['total'] <= 0 and r['counts']['malformed'] >= 1
    st = success_stats(eps)
    assert st['success_rate'] == 0 and st['n'] == 3 and set(st['by_category']) == {t.category for t in ts}
    # a context too small for the prompt stops the episode at once, still graded, still no exception
    eps = rollout(model, tiny_tok, ts[:1], max_len=64, max_new_tokens=8)
    assert eps[0].truncated and eps[0].turns == 0 and not eps[0].resolved


def test_agent_sft_stage_names_a_missing_input(tmp_path, monkeypatch):
    from composer2.stages.agent_sft import run
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'params.yaml').write_text('agent_sft:\n  tokenizer: data/no_tokenizer\n')
    from composer2.io import CheckpointError              # the init first: its tokenizer, if it carries one, is the stage's
    with pytest.raises(CheckpointError, match='data/sft/ckpt is not a checkpoint'): run()


# ---------------------------------------------------------------- the one episode scheduler (composer2.episodes)

def test_run_episodes_steps_envs_concurrently_and_in_order():
    import threading, time
    from composer2.chat import Message
    from composer2.episodes import Policy, run_episodes
    active, peak, lock = [0], [0], threading.Lock()
    class Slow:
        def __init__(self, turns): self.turns, self.n, self.closed = turns, 0, False
        def reset(self): return [Message('user', 'go')]
        def step(self, text):
            with lock: active[0] += 1; peak[0] = max(peak[0], active[0])
            time.sleep(0.2)
            with lock: active[0] -= 1
            self.n += 1
            return [Message('tool', text)], self.n >= self.turns
        def finish(self): return self.n
        def close(self): self.closed = True
    class Say(Policy):
        def advance(self, live): return [(i, f'turn {self.envs[i].n}') for i in live]
    envs = [Slow(t) for t in (2, 1, 3)]
    assert run_episodes(envs, Say(), threads=3) == [2, 1, 3]
    assert peak[0] == 3 and all(e.closed for e in envs)


@needs_sandbox
def test_a_policy_ended_episode_is_finished_as_truncated():
    from composer2.episodes import Policy, run_episodes
    t = make_tasks(2, seed=0)
    class StopSecond(Policy):
        def advance(self, live):
            out = []
            for i in live:
                if i == 1: self.envs[i].stop(); out.append((i, None))
                else: out.append((i, ToolCall('submit', {'message': 'x'}).render()))
            return out
    a, b = run_episodes([AgentEnv(t[0]), AgentEnv(t[1])], StopSecond())
    assert a.submitted and a.turns == 1 and not a.truncated
    assert b.truncated and b.turns == 0 and not b.resolved and b.grade['f2p_total'] == len(t[1].fail_to_pass)


def test_episode_names_stay_importable_from_curriculum():
    import composer2.episodes as E
    for name in ('SYSTEM_SHORT', 'AgentEnv', 'Episode', 'initial_messages'):
        assert getattr(composer2.curriculum, name) is getattr(E, name)
