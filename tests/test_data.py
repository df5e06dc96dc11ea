"Corpus building and tokenizer: real stdlib source, dedup, contamination guard, byte-exact tokenization."
import json
import numpy as np, pytest
from composer2.chat import SPECIAL_TOKENS, Message, ToolCall, encode_chat, render
from composer2.config import ConfigError
from composer2.data import DataConfig, Doc, build_corpus, dedup, exclusions_for, read_docs, reserved_package, stdlib_dir, write_docs
from composer2.tokenizer import Tokenizer, encode_stream, load_stream, save_stream

@pytest.fixture(scope='module')
def corpus():
    return build_corpus(DataConfig(max_code_files=80, prose_dirs=[], prose_max_bytes=50_000))

def test_splits_are_disjoint_and_keep_reserved_and_heldout_out(corpus):
    splits, excl, stats = corpus
    paths = {k: {d.path for d in v} for k, v in splits.items()}
    assert not paths['code_train'] & paths['heldout'] and not paths['code_val'] & paths['code_train']
    reserved = {f['path'] for f in excl['files']}
    assert 'textwrap.py' in reserved and any(p.startswith('tomllib/') for p in reserved)
    for k in ('general', 'code_train', 'code_val'):
        assert not paths[k] & reserved
        assert not {d.module for d in splits[k]} & {'email', 'json'}
    assert {d.module for d in splits['heldout']} <= {'email', 'json'}
    assert stats['reserved_files_removed'] == len(excl['files'])

def test_exclusion_hashes_match_the_files():
    ex = exclusions_for(DataConfig())
    import hashlib
    for f in ex['files'][:5]:
        assert hashlib.sha256((stdlib_dir() / f['path']).read_text(encoding='utf-8').encode()).hexdigest() == f['sha256']
    with pytest.raises(ConfigError, match="'nosuchmod' is not a module"): exclusions_for(DataConfig(reserved_modules=['nosuchmod']))

def test_reserved_sdist_packages_stay_out_of_every_split(tmp_path):
    "ReserveBench v2's sdists (cachetools, more_itertools) never reach a corpus, wherever their files are found."
    site = tmp_path / 'site-packages'
    files = {'cachetools/__init__.py': 'class LRUCache:\n    "cachetools copy"\n', 'cachetools/func.py': 'def lru_cache(): return 1\n',
             'more_itertools/more.py': 'def chunked(it, n):\n    return list(it)\n', 'more_itertools.py': 'X = 1\n'}
    files.update({f'pkg{i}/mod.py': f'def f{i}(x):\n    return x * {i} + {i * i}  # distinct {i}\n' for i in range(6)})
    for rel, t in files.items(): (site / rel).parent.mkdir(parents=True, exist_ok=True); (site / rel).write_text(t)
    whole = tmp_path / 'cachetools'; whole.mkdir(); (whole / 'keys.py').write_text('def hashkey(*a):\n    return a\n')
    cfg = DataConfig(stdlib=False, code_dirs=[str(site), str(whole)], heldout_modules=[], reserved_modules=[], prose_dirs=[], prose_max_bytes=0)
    splits, excl, stats = build_corpus(cfg)
    seen = {(d.source, d.path) for v in splits.values() for d in v if d.source != 'prose'}
    assert excl['reserved_packages'] == ['cachetools', 'more_itertools'] and stats['reserved_package_files_removed'] == 5
    assert seen and not any('cachetools' in s + p or 'more_itertools' in p for s, p in seen)
    assert reserved_package('more-itertools-10.5.0/more_itertools/recipes.py', ['more_itertools']) == 'more_itertools'
    assert reserved_package('cachetools-5.5.0/tests/test_lru.py', ['cachetools']) == 'cachetools'
    assert reserved_package('cachetoolsx/mod.py', ['cachetools']) is None
    from composer2.tasks_data import default_exclusions
    assert default_exclusions(['fnmatch'])['reserved_packages'] == ['cachetools', 'more_itertools']


def test_bad_data_config():
    with pytest.raises(ConfigError, match='both held out and reserved'): DataConfig(heldout_modules=['json'], reserved_modules=['json'])
    with pytest.raises(ConfigError, match="prose directory '/nope' does not exist"): build_corpus(DataConfig(prose_dirs=['/nope'], max_code_files=5))
    with pytest.raises(ConfigError, match='heldout_modules'): build_corpus(DataConfig(heldout_modules=['nosuchpkg'], max_code_files=5))

def test_dedup_drops_exact_and_near_but_keeps_distinct():
    rng = np.random.default_rng(0)
    words = [f'w{i}' for i in range(500)]
    a = ' '.join(rng.choice(words, 800)); b = ' '.join(rng.choice(words, 800))
    near = a.replace(a.split()[10], 'CHANGED', 1)
    kept, st = dedup([Doc('a', 's', a, 'a'), Doc('a2', 's', '  ' + a + '\n', 'a'), Doc('n', 's', near, 'n'), Doc('b', 's', b, 'b')])
    assert [d.path for d in kept] == ['a', 'b'] and st == {'exact_duplicates': 1, 'near_duplicates': 1}

def test_docs_roundtrip_and_missing_split(tmp_path):
    docs = [Doc('x.py', 's', 'print("ü")\n', 'x')]
    write_docs(tmp_path / 's.jsonl', docs); assert read_docs(tmp_path / 's.jsonl') == docs
    with pytest.raises(FileNotFoundError, match='run the data stage'): read_docs(tmp_path / 'missing.jsonl')

@pytest.fixture(scope='module')
def tok(corpus):
    splits = corpus[0]
    return Tokenizer.train([d.text for d in splits['code_train']], vocab_size=600)

def test_tokenizer_roundtrips_real_code_and_reserves_specials(tok, corpus):
    for d in corpus[0]['heldout'][:5]: assert tok.decode(tok.encode(d.text)) == d.text
    for i, t in enumerate(SPECIAL_TOKENS): assert tok.encode(t) == [i]
    assert tok.vocab_size == 600 and tok.pad_id == 0

def test_chat_mask_covers_exactly_the_assistant_turns(tok):
    msgs = [Message('system', 'sys'), Message('user', 'fix it'),
            Message('assistant', 'ok', tool_calls=[ToolCall('grep', {'pattern': 'x'})]), Message('tool', 'a.py:1'),
            Message('assistant', 'done')]
    ids, mask = encode_chat(tok, msgs)
    assert tok.decode(ids) == render(msgs)
    trained = tok.decode([i for i, m in zip(ids, mask) if m])
    assert trained == 'ok<|tool_call|>{"name": "grep", "arguments": {"pattern": "x"}}<|/tool_call|><|end|>done<|end|>'

def test_streams_roundtrip_and_truncation_is_detected(tok, tmp_path):
    arr = encode_stream(tok, ['a = 1\n', 'b = 2\n'])
    assert (arr == tok.eos_id).sum() == 2
    save_stream(tmp_path / 't.bin', arr); assert np.array_equal(load_stream(tmp_path / 't.bin'), arr)
    (tmp_path / 'bad.bin').write_bytes(b'\x01\x02\x03')
    with pytest.raises(ValueError, match='truncated'): load_stream(tmp_path / 'bad.bin')
    with pytest.raises(FileNotFoundError, match='run the tokenizer stage'): load_stream(tmp_path / 'none.bin')
    with pytest.raises(FileNotFoundError): Tokenizer.load(tmp_path / 'nothing')
    (tmp_path / 'tokenizer.json').write_text('{"not": "a tokenizer"')
    with pytest.raises(ValueError, match='corrupt'): Tokenizer.load(tmp_path)
