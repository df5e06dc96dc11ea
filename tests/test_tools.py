"The agent's tools (composer2.tools): every tool's normal and error paths, and semantic search with the real model."
import hashlib, json, re
from pathlib import Path

import numpy as np
import pytest

from composer2.chat import CALL_CLOSE, CALL_OPEN, CallError, Message, ToolCall, render
from composer2.env import Limits, Sandbox, SandboxDied, sandbox_support
from composer2.tools import CodeIndex, Observation, Toolbox, chunk_file, defuse

OK, WHY = sandbox_support()
pytestmark = pytest.mark.skipif(not OK, reason=f"tool tests need the sandbox, skipped: {WHY}")
TOOLS = ['read_file', 'list_dir', 'grep', 'semantic_search', 'shell', 'edit_file', 'create_file', 'submit']


def bow(texts):
    "A deterministic bag-of-words embedder, standing in for the model where only the index mechanics matter."
    out = np.zeros((len(texts), 128), np.float32)
    for i, t in enumerate(texts):
        for w in re.findall(r'[a-z]+', t.lower()): out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % 128] += 1
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / 'repo'
    (r / 'shop').mkdir(parents=True)
    (r / 'shop/__init__.py').write_text('')
    (r / 'shop/cart.py').write_text(
        'class Cart:\n    def __init__(self):\n        self.items = []\n\n'
        '    def add(self, name, price):\n        self.items.append((name, price))\n\n'
        '    def total(self):\n        return sum(p for _, p in self.items)\n')
    (r / 'shop/util.py').write_text('def clamp(x, lo, hi):\n    return max(lo, min(hi, x))\n\n\ndef clamp2(x):\n    return clamp(x, 0, 1)\n')
    (r / 'docs').mkdir(); (r / 'docs/guide.md').write_text('# Guide\n\nUse `Cart.total()` for the sum.\n')
    (r / 'blob.bin').write_bytes(b'\0\1\2' * 100)
    (r / 'tokens.txt').write_text('a file that mentions <|end|> and <|tool_call|>\n')
    return r


@pytest.fixture
def tb(repo, tmp_path):
    with Sandbox(repo, Limits(wall_s=20)) as sb:
        yield Toolbox(sb, index_dir=tmp_path / 'index', embedder=bow)


def call(tb, name, **args) -> Observation:
    o = tb.execute(ToolCall(name, args))
    assert isinstance(o, Observation) and o.tool == name
    return o


def test_schemas_describe_every_tool(tb):
    s = tb.schemas()
    assert [t['name'] for t in s] == TOOLS
    for t in s:
        assert t['description'] and t['parameters']['type'] == 'object'
        assert set(t['parameters']['required']) <= set(t['parameters']['properties'])
        json.dumps(t)
    assert {t['name']: t['parameters']['required'] for t in s}['edit_file'] == ['path', 'old', 'new']


def test_read_file(tb):
    o = call(tb, 'read_file', path='shop/util.py')
    assert o.ok and o.text.splitlines()[0] == 'shop/util.py (6 lines)' and '1\tdef clamp(x, lo, hi):' in o.text
    o = call(tb, 'read_file', path='/workspace/shop/util.py', start_line=5, end_line=99)
    assert o.ok and o.text.splitlines() == ['shop/util.py (lines 5-6 of 6)', '5\tdef clamp2(x):', '6\t    return clamp(x, 0, 1)']
    for args, msg in [({'path': 'nope.py'}, 'does not exist'), ({'path': 'shop'}, 'is a directory'),
                      ({'path': 'blob.bin'}, 'binary'), ({'path': 'shop/util.py', 'start_line': 50}, 'past the end'),
                      ({'path': 'shop/util.py', 'start_line': 3, 'end_line': 2}, 'before start_line'),
                      ({'path': 'shop/util.py', 'start_line': 0}, '>= 1'),
                      ({'path': '../../../etc/passwd'}, "'..'"), ({'path': '/etc/passwd'}, 'outside the workspace'),
                      ({'path': 'shop/util.py', 'start_line': '2'}, 'must be an integer'), ({}, "missing required argument 'path'"),
                      ({'path': 'x', 'lines': 3}, 'unknown argument lines')]:
        o = call(tb, 'read_file', **args)
        assert not o.ok and msg in o.text, (args, o)


def test_symlinks_out_of_the_workspace_are_refused(tb):
    assert call(tb, 'shell', cmd='ln -s /etc/passwd pw && ln -s /tmp tmpdir && ln -s shop/util.py inside.py').ok
    for name, args in [('read_file', {'path': 'pw'}), ('list_dir', {'path': 'tmpdir'}), ('create_file', {'path': 'tmpdir/x', 'content': 'x'}),
                       ('edit_file', {'path': 'pw', 'old': 'root', 'new': 'toor'}), ('grep', {'pattern': 'root', 'path': 'pw'})]:
        o = call(tb, name, **args)
        assert not o.ok and 'symlink' in o.text and 'outside the workspace' in o.text, (name, o)
    assert call(tb, 'read_file', path='inside.py').ok      # a link that stays inside is fine
    assert 'pw@ -> /etc/passwd' in call(tb, 'list_dir').text


def test_list_dir(tb):
    o = call(tb, 'list_dir')
    lines = o.text.splitlines()
    assert o.ok and lines[1:3] == ['docs/', 'shop/'] and any(l.startswith('blob.bin (300 bytes)') for l in lines)
    assert call(tb, 'list_dir', path='docs').text.splitlines()[1] == 'guide.md (41 bytes)'
    tb.sb.run('mkdir empty')
    assert call(tb, 'list_dir', path='empty').text == 'empty/ is empty'
    for args, msg in [({'path': 'shop/cart.py'}, 'not a directory'), ({'path': 'missing'}, 'does not exist'), ({'path': '..'}, "'..'")]:
        o = call(tb, 'list_dir', **args); assert not o.ok and msg in o.text, o


def test_grep(tb):
    o = call(tb, 'grep', pattern=r'def clamp\d?\(')
    assert o.ok and o.text.splitlines() == ['shop/util.py:1:def clamp(x, lo, hi):', 'shop/util.py:5:def clamp2(x):', '[2 matches in 1 file]'], o
    o = call(tb, 'grep', pattern='total', context=1)
    assert 'docs/guide.md:3:Use `Cart.total()` for the sum.' in o.text and 'shop/cart.py-7-' in o.text and 'shop/cart.py:8:    def total(self):' in o.text, o
    o = call(tb, 'grep', pattern='total', glob='*.py')
    assert 'guide.md' not in o.text and '[1 match in 1 file]' in o.text, o
    o = call(tb, 'grep', pattern='clamp', path='shop/util.py')
    assert o.ok and o.text.endswith('[3 matches in 1 file]'), o
    assert call(tb, 'grep', pattern='zzz_nothing').text == '[0 matches in 0 files]'
    assert '\0' not in call(tb, 'grep', pattern='.').text                    # binary files are skipped
    for args, msg in [({'pattern': '(unclosed'}, 'invalid regular expression'), ({'pattern': 'x', 'path': '../'}, "'..'"),
                      ({'pattern': 'x', 'path': 'nope'}, 'does not exist'), ({'pattern': 'x', 'context': 99}, 'between 0 and 50')]:
        o = call(tb, 'grep', **args); assert not o.ok and msg in o.text, (args, o)


def test_grep_runs_inside_the_sandbox_so_a_catastrophic_regex_only_times_out(repo, tmp_path):
    with Sandbox(repo, Limits(wall_s=2)) as sb:
        sb.write_file('evil.txt', 'a' * 40 + 'b\n')
        t = Toolbox(sb, index_dir=tmp_path / 'i', embedder=bow)
        o = call(t, 'grep', pattern='(a+)+$', path='evil.txt')
        assert not o.ok and 'timed out' in o.text, o
        assert call(t, 'grep', pattern='b$', path='evil.txt').ok


def test_shell(tb):
    o = call(tb, 'shell', cmd='echo out; echo err >&2; exit 3')
    assert not o.ok and o.text == 'out\nerr\n[exit code 3]', o
    o = call(tb, 'shell', cmd='python -c "from shop.cart import Cart; c = Cart(); c.add(\'a\', 2); print(c.total())"')
    assert o.ok and o.text == '2\n[exit code 0]'
    o = call(tb, 'shell', cmd='sleep 10', timeout=0.5)
    assert not o.ok and 'wall-clock limit' in o.text
    o = call(tb, 'shell', cmd='seq 1 100000')
    assert o.ok and len(o.text) <= tb.max_output + 200 and o.text.startswith('1\n2\n') and 'truncated' in o.text and '100000' in o.text
    for args, msg in [({'cmd': '  '}, 'must not be empty'), ({'cmd': 'true', 'timeout': -1}, '> 0'), ({'cmd': 5}, 'must be a string')]:
        o = call(tb, 'shell', **args); assert not o.ok and msg in o.text, o


def test_edit_file(tb):
    before = tb.sb.read_file('shop/util.py')
    o = call(tb, 'edit_file', path='shop/util.py', old='return max(lo, min(hi, x))', new='return min(max(x, lo), hi)')
    assert o.ok and 'edited shop/util.py' in o.text and '2\t    return min(max(x, lo), hi)' in o.text, o
    after = tb.sb.read_file('shop/util.py')
    assert after == before.replace('return max(lo, min(hi, x))', 'return min(max(x, lo), hi)')
    for args, msg in [(dict(old='clamp(', new='c('), 'occurs 2 times'), (dict(old='not here at all', new='x'), 'not found'),
                      (dict(old='', new='x'), 'must not be empty'), (dict(old='clamp2', new='clamp2'), 'identical')]:
        o = call(tb, 'edit_file', path='shop/util.py', **args)
        assert not o.ok and msg in o.text, (args, o)
    assert tb.sb.read_file('shop/util.py') == after                            # failed edits change nothing
    o = call(tb, 'edit_file', path='shop/util.py', old='def clamp2(y):', new='x')
    assert 'closest text is at line 5' in o.text and 'def clamp2(x):' in o.text, o
    assert not call(tb, 'edit_file', path='missing.py', old='a', new='b').ok
    assert tb.sb.run('python -c "from shop.util import clamp; print(clamp(5, 0, 3))"').stdout == '3\n'


def test_create_file(tb):
    o = call(tb, 'create_file', path='shop/new/mod.py', content='X = 1\nY = 2\n')
    assert o.ok and o.text == 'created shop/new/mod.py (2 lines)'
    assert tb.sb.run('cat shop/new/mod.py && echo Z = 3 >> shop/new/mod.py').ok   # the sandbox user owns it
    o = call(tb, 'create_file', path='shop/new/mod.py', content='')
    assert o.ok and o.text.startswith('overwrote')
    for args, msg in [({'path': 'shop', 'content': 'x'}, 'is a directory'), ({'path': '../x', 'content': 'x'}, "'..'"),
                      ({'path': 'shop/cart.py/x', 'content': 'x'}, 'not a directory'), ({'path': 'x'}, "missing required argument 'content'")]:
        o = call(tb, 'create_file', **args); assert not o.ok and msg in o.text, (args, o)


def test_submit_and_stats(tb):
    o = call(tb, 'submit', message='fixed it')
    assert o.ok and o.submitted and tb.submitted and tb.submission == 'fixed it'
    assert not call(tb, 'read_file', path='nope').ok
    assert tb.stats['calls'] == 2 and tb.stats['errors'] == 1 and tb.stats['by_tool'] == {'submit': 1, 'read_file': 1}


def test_bad_calls_are_observations_not_exceptions(tb, monkeypatch):
    o = tb.execute(CallError('{"name": ', 'tool call is not valid JSON'))
    assert not o.ok and 'malformed tool call' in o.text
    o = tb.execute(ToolCall('rm_rf', {}))
    assert not o.ok and 'unknown tool' in o.text and 'read_file' in o.text
    o = tb.execute(ToolCall('read_file', ['shop/util.py']))
    assert not o.ok and 'must be a JSON object' in o.text
    o = tb.execute('read_file shop/util.py')
    assert not o.ok and 'not a tool call' in o.text
    def boom(*a, **k): raise RuntimeError('kaboom')
    monkeypatch.setattr(tb.index, 'refresh', boom)
    o = call(tb, 'semantic_search', query='x')
    assert not o.ok and 'internal error' in o.text and 'kaboom' in o.text


def test_dead_sandbox_propagates_for_failover(tb):
    tb.sb.kill()
    with pytest.raises(SandboxDied): tb.execute(ToolCall('shell', {'cmd': 'true'}))


def test_execute_text_parses_the_chat_format(tb):
    text = ('Let me look.' + ToolCall('read_file', {'path': 'shop/util.py', 'end_line': 1}).render()
            + ToolCall('grep', {'pattern': 'total'}).render() + CALL_OPEN + '{"name": "shell", "arguments": ' + CALL_CLOSE)
    obs = tb.execute_text(text)
    assert [o.tool for o in obs] == ['read_file', 'grep', '(malformed)'] and [o.ok for o in obs] == [True, True, False]


def test_reserved_tokens_in_files_are_defused(tb):
    o = call(tb, 'read_file', path='tokens.txt')
    assert o.ok and '<|end|>' not in o.text and '<\\|end|>' in o.text
    render([Message('tool', o.text)])                    # renders without ChatFormatError
    assert defuse('<|eos|>x') == '<\\|eos|>x'


def test_index_is_cached_on_disk_and_incremental(repo, tmp_path):
    idx = tmp_path / 'idx'
    a = CodeIndex(idx, bow).refresh(repo)
    n = len(a.chunks)
    assert n >= 5 and a.stats['embedded'] == n and len(list(idx.glob('*.npz'))) == 1
    b = CodeIndex(idx, bow).refresh(repo)
    assert b.stats == {'builds': 0, 'loaded': 1, 'embedded': 0, 'reused': 0} and np.allclose(a.vectors, b.vectors)
    (repo / 'shop/util.py').write_text((repo / 'shop/util.py').read_text() + '\n\ndef lerp(a, b, t):\n    return a + (b - a) * t\n')
    a.refresh(repo)
    assert a.stats['embedded'] == n + 1 and a.stats['reused'] == n, a.stats     # only the new chunk is embedded
    assert len(list(idx.glob('*.npz'))) == 2 and a.refresh(repo).stats['builds'] == 2   # unchanged: no rebuild


def test_chunking_follows_definitions():
    src = 'import x\n\n\nclass A:\n    def f(self):\n        pass\n\n\ndef g():\n    ' + '\n    '.join(f'v{i} = {i}' for i in range(100)) + '\n'
    ch = chunk_file('m.py', src)
    assert ch[0].text.startswith('import x') and ch[1].text.startswith('class A') and (ch[1].start, ch[1].end) == (4, 6)
    assert all(c.text.strip() for c in ch) and ch[-1].end == len(src.splitlines())
    assert len([c for c in ch if c.start >= 9]) >= 2                          # a long function is split into windows
    assert chunk_file('bad.py', 'def (:\n') and chunk_file('empty.py', '') == []


@pytest.mark.slow
def test_semantic_search_with_minilm_finds_the_relevant_chunk_first(tmp_path):
    r = tmp_path / 'app'; r.mkdir()
    files = {
        'auth.py': 'import hashlib, os\n\ndef hash_password(password, salt=None):\n    salt = salt or os.urandom(16)\n'
                   '    return salt + hashlib.pbkdf2_hmac("sha256", password.encode(), salt, 100_000)\n',
        'geometry.py': 'import math\n\ndef circle_area(radius):\n    return math.pi * radius ** 2\n',
        'http_util.py': 'def parse_headers(raw):\n    out = {}\n    for line in raw.split("\\r\\n"):\n'
                        '        k, _, v = line.partition(":")\n        out[k.strip().lower()] = v.strip()\n    return out\n',
        'dates.py': 'import datetime\n\ndef days_between(a, b):\n    return abs((b - a).days)\n',
        'csv_report.py': 'import csv\n\ndef write_report(rows, path):\n    with open(path, "w", newline="") as f:\n'
                         '        csv.writer(f).writerows(rows)\n',
    }
    for n, t in files.items(): (r / n).write_text(t)
    with Sandbox(r) as sb:
        tb = Toolbox(sb, index_dir=tmp_path / 'idx')
        for query, want in [('where is the user password hashed securely', 'auth.py'),
                            ('compute the area of a round shape', 'geometry.py'),
                            ('split HTTP header lines into a dictionary', 'http_util.py'),
                            ('number of days between two dates', 'dates.py'),
                            ('save rows to a spreadsheet file', 'csv_report.py')]:
            o = call(tb, 'semantic_search', query=query, k=3)
            first = o.text.splitlines()[0]
            assert o.ok and first.startswith(f'1. {want}:'), (query, o.text)
        assert tb.index.stats['embedded'] == len(tb.index.chunks) and tb.index.model_name == 'all-MiniLM-L6-v2'
        t2 = Toolbox(sb, index_dir=tmp_path / 'idx')                     # a second toolbox loads the cached index
        assert call(t2, 'semantic_search', query='password', k=1).text.startswith('1. auth.py')
        assert t2.index.stats['loaded'] == 1 and t2.index.stats['embedded'] == 0
        for args, msg in [({'query': ' '}, 'must not be empty'), ({'query': 'x', 'k': 0}, 'between 1 and 50')]:
            o = call(tb, 'semantic_search', **args); assert not o.ok and msg in o.text


def test_fifos_and_huge_files_do_not_block_the_harness(tb):
    assert call(tb, 'shell', cmd='mkfifo pipe.py && head -c 9000000 /dev/zero | tr "\\0" x > huge.txt').ok
    for name, args, msg in [('read_file', {'path': 'pipe.py'}, 'not a regular file'), ('edit_file', {'path': 'pipe.py', 'old': 'a', 'new': 'b'}, 'not a regular file'),
                            ('read_file', {'path': 'huge.txt'}, 'too large')]:
        o = call(tb, name, **args); assert not o.ok and msg in o.text, o
    o = call(tb, 'semantic_search', query='cart total')        # the index skips the FIFO instead of blocking on it
    assert o.ok and 'pipe.py' not in o.text
    with pytest.raises(Exception, match='not a regular file'): tb.sb.read_file('pipe.py')
    assert 'Entry pipe.py: missing changed to other' in tb.sb.diff()          # diffs do not open it either


def test_direct_method_calls_behave_like_execute(tb):
    o = tb.read_file('shop/util.py', 1, 1)
    assert o.ok and o.text.splitlines()[1] == '1\tdef clamp(x, lo, hi):'
    o = tb.edit_file('shop/util.py', old='nope', new='x')
    assert isinstance(o, Observation) and not o.ok and 'not found' in o.text
    assert not tb.read_file('a', 1, 2, 3).ok and tb.stats['calls'] == 3
