"""Training stages from `init: hf:DIR` use that model's own tokenizer (composer2.tokenizer.PretrainedTokenizer), against
transformers' AutoTokenizer as the reference: a random tiny Qwen3-MoE (built by transformers from a config) with a
byte-level BPE whose vocabulary passes 16 bits (built here with `tokenizers`; nothing is downloaded) goes through the
real `cpt` and `sft` stage functions; the default (our tokenizer) path is checked unchanged."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip('transformers')
from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

from composer2.chat import ChatFormatError, Message
from composer2.data import Doc, write_docs
from composer2.tokenizer import (PretrainedTokenizer, Tokenizer, encode_stream, hf_message, load_stream, load_tokenizer,
                                 save_stream)

N_BASE, SPECIALS = 70000, ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ['def', 'return', 'self', 'Ġ=', 'ĠĠĠĠ', '"""', 'Ġx', 'ĠĠ', 'in', 'Ġin', 'for', 'Ġfor']

def _tokenizer_files(d: Path, template=CHATML):
    "A byte-level BPE of 70003 ids: bytes 0..255, fillers, merges at ids >= 65536, ChatML specials at 70000..70002."
    alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alpha)}
    merges = []
    for w in WORDS:                          # left-to-right merges: d+e -> de, de+f -> def; results get ids >= 65536
        for k in range(2, len(w) + 1):
            if w[:k] not in vocab:
                merges.append((w[:k - 1], w[k - 1])); vocab[w[:k]] = 65536 + len(merges)
    used = set(vocab.values())
    free = iter(i for i in range(N_BASE) if i not in used)
    for j in range(N_BASE - len(vocab)): vocab[f'<unused{j}>'] = next(free)
    bpe = HFTok(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.add_special_tokens(SPECIALS)
    d.mkdir(parents=True, exist_ok=True); bpe.save(str(d / 'tokenizer.json'))
    cfg = {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>',
           'bos_token': None, 'add_bos_token': False}
    if template: cfg['chat_template'] = template
    (d / 'tokenizer_config.json').write_text(json.dumps(cfg))
    return bpe

def _hf_model_dir(d: Path, template=CHATML) -> Path:
    "A random Qwen3-MoE (q/k norms, untied, head_dim != hidden/heads) whose embedding is padded past the tokenizer."
    torch.manual_seed(0)
    c = Qwen3MoeConfig(vocab_size=70016, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=12, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                       norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False)
    Qwen3MoeForCausalLM(c).save_pretrained(d)
    _tokenizer_files(d, template)
    return d

FUNCS = ['''def add{i}(x, y):
    """Add x and y, {i} times."""
    z = x + y
    for _ in range({i}):
        z = z + x
    return z
''', '''class C{i}:
    def get(self, x):
        """Return x from self."""
        y = self.v{i}
        return x if x in y else y
''']

def _corpus(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for split, n in (('code_train', 12), ('code_val', 4), ('heldout', 4)):
        write_docs(d / f'{split}.jsonl', [Doc(f'm{i}.py', 's', ''.join(f.format(i=i) for f in FUNCS) + '# é ✓\n', f'm{i}')
                                          for i in range(n)])
    return d

def _params(path: Path, **sections):
    import yaml
    path.write_text(yaml.safe_dump(sections))
    return str(path)

TRAIN = dict(steps=2, batch_size=2, seq_len=32, warmup_steps=0, eval_every=2, eval_windows=2, log_every=1, lr=1e-3)

@pytest.fixture
def hfdir(tmp_path):
    return _hf_model_dir(tmp_path / 'hfmodel')

def test_pretrained_tokenizer_matches_transformers(hfdir):
    tok, ref = load_tokenizer(hfdir), AutoTokenizer.from_pretrained(str(hfdir))
    assert isinstance(tok, PretrainedTokenizer) and tok.vocab_size == 70003 == len(ref)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (70002, 70000, None) == (ref.eos_token_id, ref.pad_token_id, ref.bos_token_id)
    text = 'def f(self):\n    """Doc."""\n    return self.x in y é ✓\n'
    ids = tok.encode(text)
    assert ids == ref(text, add_special_tokens=False)['input_ids'] and max(ids) > 65535 and tok.decode(ids) == text
    arr = encode_stream(tok, [text, 'x = 1'])
    assert arr.dtype == np.uint32 and arr.tolist() == ids + [70002] + ref('x = 1', add_special_tokens=False)['input_ids'] + [70002]
    msgs = [Message('system', 'Be brief.'), Message('user', 'Complete:\ndef f():'), Message('assistant', '    return 1\n')]
    dicts = [hf_message(m) for m in msgs]
    assert tok.render_chat(msgs) == ref.apply_chat_template(dicts, tokenize=False)
    ids, mask = tok.encode_chat(msgs)
    assert ids == list(ref.apply_chat_template(dicts, tokenize=True, return_dict=False))
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == '    return 1\n<|im_end|>\n'

def test_tokenizer_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match=r'tokenizer\.json is missing'): PretrainedTokenizer(tmp_path)
    (tmp_path / 'tokenizer.json').write_text('{"not": "a tokenizer"')
    with pytest.raises(ValueError, match=r'tokenizer\.json is unreadable or corrupt'): PretrainedTokenizer(tmp_path)
    _tokenizer_files(tmp_path / 'nt', template=None)
    tok = PretrainedTokenizer(tmp_path / 'nt')
    with pytest.raises(ChatFormatError, match='has no chat template'): tok.encode_chat([Message('user', 'hi')])
    bad = tmp_path / 'bad.bin'; bad.write_bytes(b'\0' * 6); (tmp_path / 'bad.bin.json').write_text('{"dtype": "uint32"}')
    with pytest.raises(ValueError, match='truncated'): load_stream(bad)

@pytest.fixture(scope='module')
def chain(tmp_path_factory):
    "The real `cpt` stage from hf:DIR, then `sft` from its checkpoint, in a workspace; the windows cpt's trainer got."
    import composer2.pretrain as P
    from composer2.stages import pretrain as stage_pretrain, sft as stage_sft
    ws = tmp_path_factory.mktemp('ws')
    # a template that renders tool calls (Qwen2.5's way), as real agent models' do: the harness parses calls in it
    from composer2.rl_rollout import TINY_TEMPLATE
    hfdir, corpus = _hf_model_dir(ws / 'hfmodel', TINY_TEMPLATE), _corpus(ws / 'corpus')
    fed, real_train = [], P.train
    def spy(model, cfg, batch_fn, *a, **k):                   # the windows the trainer gets, step by step
        fed.extend(batch_fn(s).x for s in range(cfg.steps))
        return real_train(model, cfg, batch_fn, *a, **k)
    params = _params(ws / 'params.yaml',
                     cpt=dict(init=f'hf:{hfdir}', out_dir='cpt', corpus_dir=str(corpus), tokenizer='no/such/tokenizer', train=TRAIN),
                     sft=dict(init='cpt/ckpt', out_dir='sft', corpus_dir=str(corpus), tokenizer='no/such/tokenizer',
                              train={**TRAIN, 'seq_len': 256}))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ws); mp.setattr(P, 'train', spy)
        m, sm = stage_pretrain.cpt(params), stage_sft.run(params)
    return dict(ws=ws, hfdir=hfdir, corpus=corpus, fed=fed, cpt=m, sft=sm, ref=AutoTokenizer.from_pretrained(str(hfdir)))

def test_cpt_from_hf_init_feeds_the_models_own_tokens(chain):
    from composer2.data import read_docs
    from composer2.train import load_model
    ws, ref, hfdir = chain['ws'], chain['ref'], chain['hfdir']
    assert np.isfinite(chain['cpt']['final_loss']) and chain['cpt']['steps'] == 2
    # the streams: the corpus split encoded by the HF tokenizer (transformers' ids), documents ended by its eos, uint32
    want = [i for d in read_docs(chain['corpus'] / 'code_train.jsonl')
            for i in ref(d.text, add_special_tokens=False)['input_ids'] + [ref.eos_token_id]]
    stream = load_stream(ws / 'cpt/tokens/code_train.bin')
    assert stream.dtype == np.uint32 and stream.tolist() == want and max(want) > 65535
    assert json.loads((ws / 'cpt/tokens/code_train.bin.json').read_text())['dtype'] == 'uint32'
    s = np.asarray(want)
    for x in torch.cat(chain['fed']):                         # every window fed is a slice of that stream
        w = x.numpy()
        assert any((s[o:o + len(w)] == w).all() for o in np.flatnonzero(s == w[0]))
    # the checkpoint carries the tokenizer: the same files, named in its meta, and load_model hands it on
    ck = ws / 'cpt/ckpt'
    assert (ck / 'tokenizer.json').read_bytes() == (hfdir / 'tokenizer.json').read_bytes()
    assert json.loads((ck / 'meta.json').read_text())['tokenizer'] == '.'
    _, meta = load_model(ck)
    assert Path(meta['tokenizer']) == ck and isinstance(load_tokenizer(meta['tokenizer']), PretrainedTokenizer)

def test_sft_from_that_checkpoint_renders_the_models_chat_template(chain):
    from composer2.data import read_docs
    from composer2.sft import encode_tasks, function_tasks, task_messages
    ws, ref = chain['ws'], chain['ref']
    assert np.isfinite(chain['sft']['heldout_completion_loss_after']) and chain['sft']['train_examples'] > 0
    tok = load_tokenizer(ws / 'sft/ckpt')
    assert isinstance(tok, PretrainedTokenizer) and (ws / 'sft/ckpt/tokenizer_config.json').exists()
    pairs = function_tasks(read_docs(chain['corpus'] / 'code_train.jsonl'))
    (ids, mask), = encode_tasks(tok, pairs[:1], 10 ** 6)
    dicts = [hf_message(x) for x in task_messages(*pairs[0])]
    assert ids == list(ref.apply_chat_template(dicts, tokenize=True, return_dict=False))
    assert tok.decode([i for i, k in zip(ids, mask) if k]) == pairs[0][1] + '<|im_end|>\n'

def test_eval_and_export_use_the_carried_tokenizer(chain, monkeypatch):
    from composer2.evaluate import EvalConfig, evaluate_checkpoints
    from composer2.stages.export_hf import run as export_run
    from composer2.train import load_model, perplexity
    ws, ref = chain['ws'], chain['ref']
    monkeypatch.chdir(ws)
    ev = evaluate_checkpoints(EvalConfig(checkpoints={'cpt': 'cpt/ckpt', 'sft': 'sft/ckpt'}, tokenizer='no/such', heldout='no/such/heldout.bin',
                                         corpus_dir=str(chain['corpus']), short_len=16, long_len=32, short_windows=2, long_windows=2,
                                         sft_max_len=257, max_heldout_tasks=2))
    held = load_stream(ws / 'cpt/tokens/heldout.bin')
    m, _ = load_model('sft/ckpt', max_seq_len=512)
    assert ev['sft']['ppl_heldout_short'] == pytest.approx(perplexity(m, held, 16, 2), rel=1e-6)
    assert ev['sft']['tokenizer'] == str(chain['hfdir']) and np.isfinite(ev['cpt']['sft_heldout_loss'])
    _params(ws / 'export.yaml', export_hf=dict(checkpoints={'sft': 'sft/ckpt'}, tokenizer='no/such', heldout='no/such/heldout.bin',
                                               corpus_dir=str(chain['corpus']), seq_len=16, windows=2))
    r = export_run('export.yaml')['sft']
    assert r['rel_diff'] < 1e-5 and r['arch'] == 'qwen3_moe', r
    out = AutoTokenizer.from_pretrained(str(ws / 'data/hf/sft'))
    assert out.get_vocab() == ref.get_vocab() and out.chat_template == ref.chat_template
    assert json.loads((ws / 'data/hf/sft/config.json').read_text())['eos_token_id'] == ref.eos_token_id

def test_save_mtp_carries_the_tokenizer(chain, tmp_path):
    from composer2.mtp import MTPHeads, load_mtp, save_mtp
    from composer2.train import load_model
    m, meta = load_model(chain['ws'] / 'sft/ckpt')
    save_mtp(tmp_path / 'mtp', m, MTPHeads(m.cfg, depth=1), {'stage': 'mtp', 'tokenizer': meta['tokenizer']})
    _, _, mm = load_mtp(tmp_path / 'mtp')
    assert isinstance(load_tokenizer(mm['tokenizer']), PretrainedTokenizer) and Path(mm['tokenizer']) == tmp_path / 'mtp'

def test_hf_init_without_chat_template_fails_sft_clearly(tmp_path):
    from composer2.sft import SFTConfig, run_sft
    from composer2.train import TrainConfig
    d = _hf_model_dir(tmp_path / 'm', template=None)
    cfg = SFTConfig(init=f'hf:{d}', out_dir=str(tmp_path / 'sft'), corpus_dir=str(_corpus(tmp_path / 'c')),
                    train=TrainConfig(**{**TRAIN, 'seq_len': 256}))
    with pytest.raises(ChatFormatError, match='no chat template'): run_sft(cfg)
    (d / 'tokenizer.json').unlink()
    with pytest.raises(FileNotFoundError, match=r'tokenizer\.json is missing'): run_sft(cfg)

def test_default_path_is_unchanged(tmp_path):
    "Our tokenizer: uint16 streams as raw bytes with nothing beside them, no tokenizer in checkpoints, the stage's files read."
    from composer2.model import ModelConfig, Transformer
    from composer2.pretrain import PretrainConfig, stage_data
    from composer2.train import TrainConfig, load_model, save_checkpoint
    tok = Tokenizer.train(['def f(x):\n    return x + 1\n'] * 40, vocab_size=300)
    tok.save_hf(tmp_path / 'tok')
    assert not isinstance(load_tokenizer(tmp_path / 'tok'), PretrainedTokenizer)
    arr = encode_stream(tok, ['def f(x): return x'] * 30)
    assert arr.dtype == np.uint16
    for s in ('a', 'b', 'c'): save_stream(tmp_path / f'{s}.bin', arr)
    assert (tmp_path / 'a.bin').read_bytes() == arr.astype(np.uint16).tobytes() and not (tmp_path / 'a.bin.json').exists()
    m = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, n_experts=2, top_k=1,
                                d_expert=16, max_seq_len=16))
    save_checkpoint(tmp_path / 'ck', m, step=1, meta={'init': ''})
    assert sorted(p.name for p in (tmp_path / 'ck').iterdir()) == ['meta.json', 'model.safetensors']
    assert 'tokenizer' not in load_model(tmp_path / 'ck')[1]
    cfg = PretrainConfig(init=str(tmp_path / 'ck'), data=str(tmp_path / 'a.bin'), val=str(tmp_path / 'b.bin'),
                         heldout=str(tmp_path / 'c.bin'), tokenizer=str(tmp_path / 'tok'), out_dir=str(tmp_path / 'out'),
                         train=TrainConfig(steps=2, batch_size=2, seq_len=8, warmup_steps=0))
    _, t, streams, meta = stage_data('cpt', cfg)
    assert type(t) is Tokenizer and meta == {'init': cfg.init} and all((s == arr).all() for s in streams)
    assert not (tmp_path / 'out').exists()

# --- agent_sft, serve from a checkpoint that carries a pretrained tokenizer ---------------------------

def test_agent_sft_trains_on_the_carried_tokenizers_chat_template(chain):
    """The real agent_sft stage from cpt/ckpt: expert transcripts rendered by the carried tokenizer's template feed the
    trainer, and its checkpoint carries the tokenizer on (the rl stage from it: `test_rl_stage_starts_from_...`)."""
    import composer2.stages.agent_sft as A
    ws, ref = chain['ws'], chain['ref']
    got, fed, real_enc, real_train = {}, [], A.encode_transcripts, A.train
    def enc(tok, transcripts, L):
        got.setdefault('transcripts', transcripts); got['L'] = L
        return real_enc(tok, transcripts, L)
    def spy(model, cfg, batch_fn, *a, **k):
        fed.extend(batch_fn(s).x for s in range(cfg.steps))
        return real_train(model, cfg, batch_fn, *a, **k)
    params = _params(ws / 'params_agent.yaml',
                     agent_sft=dict(init='cpt/ckpt', out_dir='agent_sft', tokenizer='no/such/tokenizer', n_train=2, n_heldout=1,
                                    backend='local', workers=1, validate_heldout=False, max_turns=1, max_new_tokens=4,
                                    eval_samples=0, eval_greedy=False, categories=['docs'], train={**TRAIN, 'seq_len': 128}))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ws); mp.setattr(A, 'encode_transcripts', enc); mp.setattr(A, 'train', spy)
        m = A.run(params)
    want = [list(ref.apply_chat_template([hf_message(x) for x in t], tokenize=True, return_dict=False))[:got['L']]
            for t in got['transcripts']]
    assert m['n_trajectories'] == 2 and all(w[0] == 70001 for w in want)          # <|im_start|>: the template's ids
    rows = [r.tolist() for x in fed for r in x]
    assert rows and all(any(r[:len(w) - 1] == w[:-1] and set(r[len(w) - 1:]) <= {70000} for w in want) for r in rows)
    ck = ws / 'agent_sft' / 'ckpt'
    assert (ck / 'tokenizer.json').read_bytes() == (chain['hfdir'] / 'tokenizer.json').read_bytes()
    assert json.loads((ck / 'meta.json').read_text())['tokenizer'] == '.'

def test_rollout_prompts_are_the_templates_generation_prompt(chain):
    "GeneratePolicy with a pretrained tokenizer: the prompt is apply_chat_template(..., add_generation_prompt=True)."
    import composer2.decoding as D
    from composer2.curriculum import make_tasks, rollout
    from composer2.tokenizer import stage_tokenizer
    from composer2.train import load_model
    model, meta = load_model(chain['ws'] / 'cpt' / 'ckpt')
    tok, ref, prompts, real = stage_tokenizer('no/such/tokenizer', meta), chain['ref'], [], D.generate
    def gen(model, p, **k):
        prompts.extend(p); return real(model, p, **k)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(D, 'generate', gen)
        eps = rollout(model, tok, make_tasks(1, 0, 'heldout', ['docs'], 0.0), 0.0, 1, 3, backend='local', max_len=100000)
    from composer2.episodes import initial_messages
    first = [hf_message(x) for x in initial_messages(make_tasks(1, 0, 'heldout', ['docs'], 0.0)[0])]
    assert len(eps) == 1 and prompts[0] == list(ref.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert tok.stop_ids == (70002,)

def test_serve_uses_the_carried_tokenizer(chain, tmp_path):
    "`composer2 serve sft/ckpt` (no --tokenizer) renders requests with the carried template; a different --tokenizer is refused."
    import time
    openai = pytest.importorskip('openai')
    from composer2.config import ConfigError
    from composer2.serve import load_served
    ck, ref = chain['ws'] / 'sft' / 'ckpt', chain['ref']
    other = Tokenizer.train(['def f(x):\n    return x\n'] * 20, vocab_size=300); other.save(tmp_path / 'tokenizer.json')
    with pytest.raises(ConfigError, match='differs from the one the checkpoint carries'): load_served(ck, tmp_path, 'cpu')
    assert isinstance(load_served(ck, ck, 'cpu')[1], PretrainedTokenizer)          # naming the carried one is fine
    from conftest import start_server, stop_server
    p, url, out = start_server([ck, '--device', 'cpu'])
    try:
        c = openai.OpenAI(base_url=url, api_key='EMPTY', max_retries=0, timeout=60)
        name = c.models.list().data[0].id
        msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'def f(self): return self.x'}]
        r = c.chat.completions.create(model=name, messages=msgs, max_tokens=3, temperature=0, extra_body={'ignore_eos': True})
        want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.usage.prompt_tokens == len(want) and r.usage.completion_tokens == 3
    finally:
        stop_server(p)

# --- RL through the pretrained tokenizer's own chat template (composer2.chat_format, rl_rollout.TemplateCodec) ------------

from composer2.rl_rollout import TINY_TEMPLATE          # a Qwen2.5-style template: tool calls as <tool_call> JSON

@pytest.fixture(scope='module')
def qwen_tok(tmp_path_factory):
    "The 70003-id byte-level BPE above with a Qwen2.5-style template that renders tool calls; transformers' AutoTokenizer of it."
    d = tmp_path_factory.mktemp('qwen') / 'tok'
    _tokenizer_files(d, TINY_TEMPLATE)
    return PretrainedTokenizer(d), AutoTokenizer.from_pretrained(str(d))

def _generated(tok, conv, said):
    "The ids the model generates for turn `said` after `conv`: the template's text of that turn, closed by the stop token."
    turn = tok.render_chat(conv + [said])[len(tok.render_chat(conv, add_generation_prompt=True)):]
    return tok.encode(turn[:turn.index('<|im_end|>')]) + [tok.token_id('<|im_end|>')]

def test_template_codec_ids_are_the_templates_rendering_of_the_whole_conversation(qwen_tok):
    "prompt + generated turns + observations == apply_chat_template(whole conversation, add_generation_prompt=True)."
    from composer2.chat import ToolCall
    from composer2.rl_rollout import SUMMARY_REQUEST, TemplateCodec, make_codec
    tok, ref = qwen_tok
    codec = make_codec(tok)
    assert isinstance(codec, TemplateCodec) and (codec.end, codec.eos) == (70002, 70002) and codec.sum_close == -1
    conv = [Message('system', 'You are a coding agent.'), Message('user', 'Fix def f(self): return self.x in y')]
    ids = codec.prompt(conv)
    turns = [(Message('assistant', 'Reading.', [ToolCall('read_file', {'path': 'a.py', 'n': 3})]), [Message('tool', 'def f(x):\n    return x é ✓')]),
             (Message('assistant', '', [ToolCall('grep', {'pattern': 'def'}), ToolCall('shell', {'cmd': 'ls'})]),
              [Message('tool', 'a.py:1'), Message('tool', 'a.py b.py')]),
             (Message('assistant', 'Done for x in y.'), [Message('user', 'Go on.')])]
    for said, obs in turns:
        gen = _generated(tok, conv, said)
        assert codec.fmt.parse(codec.decode(gen)).calls == said.tool_calls          # the calls parse back from the ids
        conv = conv + [said] + obs; ids = ids + gen + codec.observation(obs)
        want = ref.apply_chat_template([hf_message(m) for m in conv], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert ids == list(want)
    # the summary request: the template's text of the request turn and its generation prompt, then the plain-text marker
    conv = conv + [Message('assistant', 'ok')]
    req = codec.summary_request([Message('tool', 'x')])
    base = ref.apply_chat_template([hf_message(m) for m in conv], tokenize=False)
    want = ref.apply_chat_template([hf_message(m) for m in conv + [Message('tool', 'x'), Message('user', SUMMARY_REQUEST)]],
                                   add_generation_prompt=True, tokenize=False)
    assert want.startswith(base) and tok.decode([70002] + req) == want[base.rindex('<|im_end|>'):] + '<summary>'
    ctx = tok.decode(codec.summary_context(tok.encode('I read a.py.')))
    assert ctx == '<summary>I read a.py.</summary><|im_end|>\n<|im_start|>assistant\n'

def test_tool_calls_in_the_templates_format_parse_and_run_in_the_harness(qwen_tok, tmp_path):
    "A turn in the template's format (<tool_call> JSON) parses to the right ToolCall; AgentEnv runs it with that format."
    from composer2.chat import ToolCall
    from composer2.chat_format import chat_format
    from composer2.curriculum import make_tasks
    from composer2.episodes import AgentEnv
    tok, _ = qwen_tok
    fmt = chat_format(tok)
    assert fmt.call_markers == ('<tool_call>', '</tool_call>') and fmt.end_text == '<|im_end|>'
    text = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "README.md"}}\n</tool_call><|im_end|>'
    p = fmt.parse(text)
    assert p.calls == [ToolCall('read_file', {'path': 'README.md'})] and p.content == 'Let me look.' and not p.errors
    assert [e.message for e in fmt.parse('<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call>').errors] == ['"arguments" must be a JSON object']
    task = make_tasks(1, 0, 'heldout', ['docs'], 0.0)[0]
    env = AgentEnv(task, backend='local'); env.chat_format = fmt
    try:
        new, done = env.step(text.replace('README.md', sorted(task.files)[0]))
        assert [m.role for m in new] == ['assistant', 'tool'] and new[0].tool_calls[0].name == 'read_file' and not done
        assert env.n_calls == 1 and env.n_err == 0
    finally: env.close()

def test_rollout_with_a_pretrained_tokenizer_runs_to_the_end_through_summaries(qwen_tok):
    "rollout_batch with the template codec on a tiny model and ToyEnv: every episode ends; segments are prompt/obs + generated."
    from composer2.model import ModelConfig, Transformer
    from composer2.rl_rollout import RolloutConfig, ToyEnv, make_codec, rollout_batch
    tok, _ = qwen_tok
    codec = make_codec(tok)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=70016, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, top_k=2,
                                    d_expert=32, max_seq_len=512, init_std=0.1))
    cfg = RolloutConfig(max_new_tokens=6, max_turns=5, context_budget=96, summary_max_tokens=6, dtype='float32', env_threads=1)
    envs = [ToyEnv(turns=5, obs_words=6, seed=s) for s in range(3)]
    eps, _ = rollout_batch(model, codec, envs, cfg, generator=[torch.Generator().manual_seed(s) for s in range(3)])
    prompt = codec.prompt(ToyEnv().reset())
    assert len(eps) == 3 and sum(e['n_summaries'] for e in eps) > 0
    for e in eps:
        segs = e['segments']
        assert 1 <= e['turns'] <= 5 and len(segs) == e['n_summaries'] + 1
        for s in segs:
            assert s.ids[:len(prompt)].tolist() == prompt and s.mask[:len(prompt)].sum() == 0 and s.ids.max() < 70003
            assert (s.blogp[s.mask == 0] == 0).all() and (s.blogp[s.mask == 1] <= 0).all() and s.n_gen > 0
        for s in segs[1:]:                     # a summary context follows the prompt: '<summary>' + the summary's tokens
            assert tok.decode(s.ids[len(prompt):].tolist()).startswith('<summary>')

def test_rl_stage_starts_from_a_checkpoint_carrying_a_pretrained_tokenizer(chain, monkeypatch):
    "The real rl stage (one step, local env, the sync backend) from cpt/ckpt: it trains and its checkpoint carries the tokenizer."
    import composer2.stages.rl as S
    ws = chain['ws']
    monkeypatch.chdir(ws)
    monkeypatch.setattr(S, 'curriculum_system', lambda: 'Act through tool calls.')     # a short prompt: the model has 512 positions
    seen = []
    real = S.run_rl
    def spy(cfg, model, tokenizer_json, *a, **k):
        seen.append(tokenizer_json); return real(cfg, model, tokenizer_json, *a, **k)
    monkeypatch.setattr(S, 'run_rl', spy)
    _params(ws / 'params_rl.yaml', rl=dict(init='cpt/ckpt', tokenizer='no/such/tokenizer', out_dir='rl', n_train_tasks=2, steps=1,
                                           groups_per_step=1, group_size=2, backend='sync', env_backend='local', ckpt_every=1,
                                           mismatch_every=0, categories=['docs'],
                                           rollout=dict(max_new_tokens=4, max_turns=1, context_budget=200, summary_max_tokens=4,
                                                        dtype='float32', env_threads=1)))
    m = S.run('params_rl.yaml')
    assert m['steps'] == 1 and np.isfinite(m['reward_first_quarter'])
    assert json.loads(seen[0])['composer2_pretrained_tokenizer']['tokenizer.json'] == (chain['hfdir'] / 'tokenizer.json').read_text()
    ck = ws / 'rl' / 'ckpt'
    assert (ck / 'tokenizer.json').read_bytes() == (chain['hfdir'] / 'tokenizer.json').read_bytes()
    assert isinstance(load_tokenizer(ck), PretrainedTokenizer)

def test_eval_rollouts_of_a_checkpoint_carrying_a_pretrained_tokenizer(chain, monkeypatch):
    "eval_rl's and screen's rollouts (`rl_eval._eval_ckpt`) of cpt/ckpt through its own template, where they used to refuse."
    import functools
    from composer2.curriculum import make_tasks
    from composer2.rl_rollout import RolloutConfig, harness_env_factory
    from composer2.rl_eval import _eval_ckpt
    from composer2.tokenizer import stage_tokenizer
    ws = chain['ws']
    monkeypatch.chdir(ws)
    tok = stage_tokenizer('no/such/tokenizer', ws / 'cpt' / 'ckpt')
    jobs = [{'task': t, 'system': 'Act through tool calls.', 'prompt_id': t.id, 'group_id': i, 'group_size': 2}
            for i, t in enumerate(make_tasks(2, 0, 'heldout', ['docs'], 0.0))]
    rc = RolloutConfig(max_new_tokens=4, max_turns=1, context_budget=200, summary_max_tokens=4, dtype='float32', env_threads=1)
    res, _ = _eval_ckpt(ws / 'cpt' / 'ckpt', tok, jobs, functools.partial(harness_env_factory, backend='local', max_turns=1),
                        rc, 2, 0, 1)
    assert [len(ts) for _, ts in res] == [2, 2] and all(t.segments and t.gen_tokens > 0 for _, ts in res for t in ts)
    prompt = tok.prompt_ids([Message('system', 'Act through tool calls.'), Message('user', jobs[0]['task'].prompt)])
    assert res[0][1][0].segments[0].ids[:len(prompt)].tolist() == prompt
