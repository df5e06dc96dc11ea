"""Hugging Face checkpoints both ways (composer2.hf), against transformers (pinned in the venv) as the reference:
export -> AutoModelForCausalLM logits, export -> import, random Qwen2-MoE / Qwen3-MoE built by transformers -> import,
RoPE scaling bit for bit, and the tokenizer's chat template. Tiny models with randomised weights; nothing downloaded."""
import json, math
import pytest, torch

transformers = pytest.importorskip('transformers')
from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from composer2.decoding import generate
from composer2.hf import HFError, export_hf, hf_arch, import_hf
from composer2.model import ModelConfig, Transformer
from composer2.rope import RopeScaling, rope_inv_freq

TOL = 1e-4   # fp32, max |delta logit|

def _randomise(model, seed=0, std=0.15):
    "Every weight random: linear weights ~ N(0, std), biases ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.1), gates too."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if 'norm' in n and p.dim() == 1: p.copy_(1 + 0.1 * r)
            elif n.endswith('bias'): p.copy_(0.1 * r)
            else: p.copy_(std * r)
    return model

def _ours(**kw):
    base = dict(vocab_size=96, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=6, top_k=2, d_expert=16,
                n_dense_layers=1, d_dense=40, max_seq_len=64)
    return ModelConfig(**{**base, **kw})

def _hf_logits(d, ids):
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation='eager').eval()
    with torch.no_grad(): return hf(torch.as_tensor(ids)).logits, hf

def _our_logits(m, ids):
    with torch.no_grad(): return m.eval()(torch.as_tensor(ids)).logits

@pytest.mark.numerics
@pytest.mark.parametrize('kw', [dict(), dict(tie_embeddings=False, n_shared_experts=0, norm_topk=False),
                                dict(qk_norm=True, n_shared_experts=0, head_size=12, tie_embeddings=False),
                                dict(qkv_bias=True, shared_gate=True, d_shared=24, head_size=12)])
def test_export_loads_in_transformers_with_our_logits(tmp_path, kw):
    torch.manual_seed(0)
    m = _randomise(Transformer(_ours(**kw)))
    export_hf(m, tmp_path)
    ids = torch.randint(0, 96, (2, 24))
    theirs, hf = _hf_logits(tmp_path, ids)
    assert type(hf).__name__ == ('Qwen3MoeForCausalLM' if kw.get('qk_norm') else 'Qwen2MoeForCausalLM')
    assert (theirs - _our_logits(m, ids)).abs().max() < TOL
    back = import_hf(tmp_path)                                              # export -> import: exact
    assert torch.equal(_our_logits(back, ids), _our_logits(m, ids))

@pytest.mark.numerics
@pytest.mark.parametrize('kind', ['yarn', 'linear'])
def test_export_yarn_x8_at_8x_the_original_context(tmp_path, kind):
    torch.manual_seed(1)
    m = _randomise(Transformer(_ours(max_seq_len=32)))
    m.set_rope_scaling(RopeScaling(kind, 8.0, 32), max_seq_len=256)
    export_hf(m, tmp_path)
    assert json.loads((tmp_path / 'config.json').read_text())['rope_parameters']['rope_type'] == kind
    ids = torch.randint(0, 96, (1, 256))
    theirs, hf = _hf_logits(tmp_path, ids)
    assert hf.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(8) + 1 if kind == 'yarn' else 1.0)
    assert (theirs - _our_logits(m, ids)).abs().max() < TOL
    assert torch.equal(_our_logits(import_hf(tmp_path), ids), _our_logits(m, ids))

class _RopeCfg:
    "The attributes transformers' RoPE init functions read."
    def __init__(self, head_dim, params, max_pos):
        self.head_dim, self.hidden_size, self.num_attention_heads, self.max_position_embeddings = head_dim, head_dim * 4, 4, max_pos
        self.rope_parameters = params
    def standardize_rope_params(self): pass

@pytest.mark.numerics
@pytest.mark.parametrize('head_dim,theta,factor,orig,extra', [(32, 10000.0, 8.0, 32, {}), (64, 1e6, 4.0, 4096, {}),
                         (128, 5e5, 16.0, 8192, dict(beta_fast=16.0, beta_slow=2.0)), (64, 10000.0, 8.0, 2048, dict(truncate=False))])
def test_rope_scaling_is_transformers_bit_for_bit(head_dim, theta, factor, orig, extra):
    for kind in ('yarn', 'linear'):
        p = dict(rope_type=kind, rope_theta=theta, factor=factor, original_max_position_embeddings=orig, **(extra if kind == 'yarn' else {}))
        ref, ref_scale = ROPE_INIT_FUNCTIONS[kind](_RopeCfg(head_dim, p, int(orig * factor)), 'cpu')
        ours, scale = rope_inv_freq(head_dim, theta, RopeScaling(kind, factor, orig, **extra) if kind == 'yarn' else RopeScaling(kind, factor, orig))
        assert torch.equal(ours, ref) and scale == pytest.approx(ref_scale, abs=0, rel=1e-15), (kind, (ours - ref).abs().max())

def _qwen2(**kw):
    c = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
             mlp_only_layers=[0], max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**c, **kw}))

def _qwen3(**kw):
    c = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=12, moe_intermediate_size=16, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
             mlp_only_layers=[], max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**c, **kw}))

@pytest.mark.numerics
@pytest.mark.parametrize('build', [lambda: _qwen2(), lambda: _qwen2(tie_word_embeddings=True, norm_topk_prob=True, mlp_only_layers=[]),
                                   lambda: _qwen3(), lambda: _qwen3(attention_bias=True, mlp_only_layers=[0]),
                                   lambda: _qwen3(rope_parameters=dict(rope_type='yarn', rope_theta=10000.0, factor=4.0,
                                                                      original_max_position_embeddings=32))])
def test_random_transformers_models_import_with_their_logits_and_greedy_tokens(tmp_path, build):
    torch.manual_seed(2)
    hf = _randomise(build(), seed=3).eval()
    if hf.config.tie_word_embeddings: hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.save_pretrained(tmp_path)
    m = import_hf(tmp_path).eval()
    c = m.cfg
    assert (c.qk_norm, c.shared_gate) == ((True, False) if 'Qwen3' in type(hf).__name__ else (False, True))
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad(): theirs = hf(ids).logits
    assert (theirs - _our_logits(m, ids)).abs().max() < TOL
    prompt = ids[:1, :7]
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 7:].tolist()
    assert generate(m, [prompt[0].tolist()], max_new_tokens=12).tokens[0] == want

def test_import_errors_name_the_problem(tmp_path):
    with pytest.raises(HFError, match='config.json is missing'): import_hf(tmp_path)
    (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'mixtral'}))
    with pytest.raises(HFError, match="'mixtral' is not supported"): import_hf(tmp_path)
    (tmp_path / 'config.json').write_text('{not json')
    with pytest.raises(HFError, match='invalid JSON'): import_hf(tmp_path)
    hf = _qwen3(); hf.config.hidden_act = 'gelu'; hf.save_pretrained(tmp_path)
    with pytest.raises(HFError, match="hidden_act 'gelu'"): import_hf(tmp_path)

def test_unexportable_models_say_why():
    with pytest.raises(HFError, match='sigmoid router'): hf_arch(_ours(router='sigmoid'))
    with pytest.raises(HFError, match='shared expert'): hf_arch(_ours(qk_norm=True))
    m = Transformer(_ours()); m.layers[1].ffn.router_bias[0] = 0.5
    with pytest.raises(HFError, match='expert-selection biases'): export_hf(m, '/nonexistent/never-written')

def test_import_reads_fused_experts_as_transformers_5_holds_them(tmp_path):
    "Experts stored fused (`mlp.experts.gate_up_proj` [E, 2h, d], `down_proj` [E, d, h]) import like per-expert ones."
    from safetensors.torch import load_file, save_file
    torch.manual_seed(4)
    hf = _randomise(_qwen2(), seed=5).eval(); hf.save_pretrained(tmp_path)
    ref = import_hf(tmp_path)
    t = load_file(str(tmp_path / 'model.safetensors'))
    for i in (1, 2):
        p = f'model.layers.{i}.mlp.experts'
        t[f'{p}.gate_up_proj'] = torch.stack([torch.cat([t.pop(f'{p}.{e}.gate_proj.weight'), t.pop(f'{p}.{e}.up_proj.weight')]) for e in range(6)])
        t[f'{p}.down_proj'] = torch.stack([t.pop(f'{p}.{e}.down_proj.weight') for e in range(6)])
    save_file(t, str(tmp_path / 'model.safetensors'))
    ids = torch.randint(0, 96, (1, 16))
    assert torch.equal(_our_logits(import_hf(tmp_path), ids), _our_logits(ref, ids))

def test_exported_tokenizer_chat_template_equals_render(tmp_path):
    import dataclasses
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from composer2.chat import BOS, END, EOS, PAD, Message, ToolCall, encode_chat, render
    from composer2.tokenizer import Tokenizer
    tok = Tokenizer.train(['def f(x):\n    return x + 1\n', 'Run the tests, then fix the bug. ünïcødé ✓'] * 40, vocab_size=400)
    torch.manual_seed(0)
    export_hf(Transformer(_ours(vocab_size=tok.vocab_size)), tmp_path, tokenizer=tok)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (BOS, EOS, PAD) and hf.pad_token_id == tok.pad_id
    assert json.loads((tmp_path / 'generation_config.json').read_text())['eos_token_id'] == [tok.eos_id, tok.token_id(END)]
    shapes = [
        [Message('user', 'hi')],
        [Message('system', 'You are a coding agent.'), Message('user', 'tests fail:\n  x == 1'), Message('assistant', 'Fixed.')],
        [Message('user', 'look'), Message('assistant', '', tool_calls=[ToolCall('read_file', {'path': 'a.py'})]),
         Message('tool', 'def f(): pass\n'), Message('assistant', 'Two calls.', tool_calls=[
             ToolCall('run', {'cmd': 'pytest -q', 'timeout': 30, 'env': {'A': [1, 2.5, None, True]}}), ToolCall('ls')]),
         Message('tool', ''), Message('tool', 'ünïcødé ✓ "quoted"')],
        [Message('assistant', 'so far', summary='read a.py; é'), Message('user', '')],
        [Message('assistant', 'both', tool_calls=[ToolCall('grep', {'pattern': 'def'})], summary='s')],
    ]
    for msgs in shapes:
        dicts = [dataclasses.asdict(m) for m in msgs]
        for gen in (False, True):
            text = hf.apply_chat_template(dicts, tokenize=False, add_generation_prompt=gen)
            assert text == render(msgs, gen), (text, render(msgs, gen))
        ids = hf.apply_chat_template(dicts, tokenize=True, return_dict=False)
        assert list(ids) == encode_chat(tok, msgs)[0]
    # plain dicts as OpenAI clients send them: no summary key, content None beside tool calls, calls wrapped in "function"
    oai = [{'role': 'user', 'content': 'go'}, {'role': 'assistant', 'content': None, 'tool_calls': [
        {'type': 'function', 'function': {'name': 'ls', 'arguments': {'path': '.'}}}]}, {'role': 'tool', 'content': 'a.py'}]
    want = render([Message('user', 'go'), Message('assistant', '', tool_calls=[ToolCall('ls', {'path': '.'})]), Message('tool', 'a.py')])
    assert hf.apply_chat_template(oai, tokenize=False) == want
    with pytest.raises(Exception, match='unknown role'): hf.apply_chat_template([{'role': 'robot', 'content': 'x'}], tokenize=False)

def test_cli_export_hf_with_mtp_heads_and_hf_init(tmp_path, capsys):
    from safetensors.torch import load_file
    from composer2.cli import main
    from composer2.mtp import MTPHeads, save_mtp
    from composer2.train import load_model
    torch.manual_seed(5)
    m = _randomise(Transformer(_ours()))
    mtp = MTPHeads(m.cfg, depth=2)
    save_mtp(tmp_path / 'ck', m, mtp)
    assert main(['export-hf', str(tmp_path / 'ck'), str(tmp_path / 'hf')]) == 0
    ids = torch.randint(0, 96, (2, 16))
    theirs, _ = _hf_logits(tmp_path / 'hf', ids)
    assert (theirs - _our_logits(m, ids)).abs().max() < TOL
    heads = load_file(str(tmp_path / 'hf' / 'mtp.safetensors'))
    assert all(torch.equal(heads[k], v) for k, v in mtp.state_dict().items())
    assert json.loads((tmp_path / 'hf' / 'mtp_config.json').read_text())['depth'] == 2
    # any stage's `init` may name hf:DIR (train.load_model): the model, and DIR as its tokenizer
    m2, meta = load_model(f"hf:{tmp_path / 'hf'}", max_seq_len=128)
    assert meta['tokenizer'] == str(tmp_path / 'hf') and m2.cfg.max_seq_len == 128
    assert torch.equal(_our_logits(m2, ids), _our_logits(m, ids))
    assert main(['export-hf', str(tmp_path / 'missing'), str(tmp_path / 'x')]) == 2
    m.cfg.router = 'sigmoid'; save_mtp(tmp_path / 'ck2', m, mtp)
    assert main(['export-hf', str(tmp_path / 'ck2'), str(tmp_path / 'y')]) == 2 and 'sigmoid router' in capsys.readouterr().err

def test_import_reads_sharded_checkpoints_and_keeps_a_dtype(tmp_path):
    torch.manual_seed(6)
    hf = _randomise(_qwen3(), seed=7).eval(); hf.save_pretrained(tmp_path, max_shard_size='20KB')
    assert (tmp_path / 'model.safetensors.index.json').exists() and len(list(tmp_path.glob('model-*.safetensors'))) > 1
    m = import_hf(tmp_path)
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad(): assert (hf(ids).logits - _our_logits(m, ids)).abs().max() < TOL
    mb = import_hf(tmp_path, dtype=torch.bfloat16)
    assert mb.embed.weight.dtype == torch.bfloat16 and torch.equal(mb.embed.weight, hf.model.embed_tokens.weight.bfloat16())

def test_pretraining_from_hf_init_checks_the_vocabulary(tmp_path):
    from composer2.config import ConfigError
    from composer2.pretrain import PretrainConfig, build_model
    export_hf(Transformer(_ours()), tmp_path)
    m, _ = build_model(PretrainConfig(init=f'hf:{tmp_path}'), None, 96)
    assert m.cfg.vocab_size == 96
    with pytest.raises(ConfigError, match='differs from the tokenizer'): build_model(PretrainConfig(init=f'hf:{tmp_path}'), None, 4096)
