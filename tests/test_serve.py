"""End to end: `composer2 serve` on a tiny checkpoint, driven by the official `openai` client; `composer2 bench --agent openai`
against it; re-grading its predictions file. The checkpoint is a tiny random model first fitted (a few seconds) to answer two
fixed prompts with a tool call, so the tool-call path is exercised by what the model really generates."""
import json, os, subprocess, sys, threading, time
from pathlib import Path
import pytest, torch

from conftest import ROOT, TOY_ORIG, start_server, stop_server, toy_task
from composer2.chat import Message, ToolCall, END, render
from composer2.serve import parse_tools, to_messages

openai = pytest.importorskip('openai')
WEATHER = [{'type': 'function', 'function': {'name': 'get_weather', 'description': 'the weather in a city',
                                             'parameters': {'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}]
WEATHER_Q = [{'role': 'user', 'content': 'What is the weather in Paris?'}]
FIX = ToolCall('create_file', {'path': 'toymod.py', 'content': TOY_ORIG})


def _bench_prompt():
    "The first request `OpenAIAgent` sends for the toy task, rendered as the server renders it."
    from composer2.agents import openai_messages, openai_tools
    from composer2.episodes import initial_messages
    return render(to_messages(openai_messages(initial_messages(toy_task())), parse_tools(openai_tools())), add_generation_prompt=True)


def _weather_prompt(): return render(to_messages(WEATHER_Q, parse_tools(WEATHER)), add_generation_prompt=True)


def _fit(model, tok, pairs, steps=150, lr=1e-2, target=0.004):
    "Teach `model` to answer each prompt text with its reply text (loss on the reply tokens only), until the loss is below `target`."
    seqs = [(tok.encode(p), tok.encode(r)) for p, r in pairs]
    T = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long); mask = torch.zeros(len(seqs), T)
    for i, (p, r) in enumerate(seqs):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r); mask[i, len(p):len(p) + len(r)] = 1
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        logits = model(ids).logits[:, :-1]
        loss = (torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction='none')
                * mask[:, 1:].reshape(-1)).sum() / mask.sum()
        if loss < target: break
        opt.zero_grad(); loss.backward(); opt.step()
    return float(loss.detach())


@pytest.fixture(scope='module')
def tiny_ckpt(tmp_path_factory):
    from composer2.tokenizer import Tokenizer
    from composer2.model import Transformer, ModelConfig
    from composer2.train import save_checkpoint
    d = tmp_path_factory.mktemp('serve')
    bench_p, weather_p = _bench_prompt(), _weather_prompt()
    fix, call = FIX.render() + END, ToolCall('get_weather', {'city': 'Paris'}).render() + END
    tok = Tokenizer.train([bench_p, weather_p, fix, call, TOY_ORIG] * 3 + ['say a word ok fine next go'] * 3, vocab_size=1024, min_frequency=1)
    tok.save(d / 'tok' / 'tokenizer.json')
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.vocab_size, d_model=48, n_layers=2, n_heads=2, n_kv_heads=1, n_experts=4, top_k=2,
                                    d_expert=48, max_seq_len=4096, init_std=0.1))
    loss = _fit(model, tok, [(bench_p, fix), (weather_p, call)])
    assert loss < 0.004, loss
    save_checkpoint(d / 'tiny', model)
    return d / 'tiny', d / 'tok'


@pytest.fixture(scope='module')
def server(tiny_ckpt):
    ckpt, tokdir = tiny_ckpt
    p, url, out = start_server([ckpt, '--tokenizer', tokdir])
    client = openai.OpenAI(base_url=url, api_key='EMPTY', max_retries=0, timeout=60)
    yield url, client
    stop_server(p)


def _stats(url):
    import httpx
    return httpx.get(url + '/stats').json()


def test_openai_client(server):
    url, c = server
    assert [m.id for m in c.models.list().data] == ['tiny']
    r = c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'say a word'}], max_tokens=8, temperature=0.7, seed=3)
    assert r.choices[0].finish_reason in ('stop', 'length') and 0 < r.usage.completion_tokens <= 8
    again = c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'say a word'}], max_tokens=8, temperature=0.7, seed=3)
    assert again.choices[0].message.content == r.choices[0].message.content          # a seed is a per-request stream
    # streamed: the deltas add up to the non-streamed greedy answer
    kw = dict(model='tiny', messages=[{'role': 'user', 'content': 'ok fine'}], max_tokens=10, temperature=0, extra_body={'ignore_eos': True})
    whole = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert ''.join(ch.choices[0].delta.content or '' for ch in chunks if ch.choices) == whole
    assert chunks[-1].choices[0].finish_reason == 'length'
    # sampled bytes (a byte-level vocabulary: characters split over tokens) stream to the same text as a seeded whole reply
    kw = dict(kw, temperature=1.0, seed=11, max_tokens=60)
    whole = c.chat.completions.create(**kw).choices[0].message.content
    assert ''.join(ch.choices[0].delta.content or '' for ch in c.chat.completions.create(stream=True, **kw) if ch.choices) == whole
    # the fitted tool call, plain and streamed
    r = c.chat.completions.create(model='tiny', messages=WEATHER_Q, tools=WEATHER, temperature=0)
    tc = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == 'tool_calls' and tc[0].function.name == 'get_weather'
    assert json.loads(tc[0].function.arguments) == {'city': 'Paris'} and tc[0].id.startswith('call_')
    s = [ch for ch in c.chat.completions.create(model='tiny', messages=WEATHER_Q, tools=WEATHER, temperature=0, stream=True) if ch.choices]
    calls = [t for ch in s for t in (ch.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == 'get_weather' and s[-1].choices[0].finish_reason == 'tool_calls'
    # the conversation goes on with the tool's answer, answering the call by its id
    follow = WEATHER_Q + [r.choices[0].message.model_dump(exclude_none=True), {'role': 'tool', 'tool_call_id': tc[0].id, 'content': 'sunny'}]
    assert c.chat.completions.create(model='tiny', messages=follow, tools=WEATHER, max_tokens=4).choices[0].finish_reason


def test_concurrent_requests_share_decode_steps(server):
    url, c = server
    before = _stats(url)
    kw = dict(model='tiny', max_tokens=120, temperature=0, extra_body={'ignore_eos': True})
    msgs = [[{'role': 'user', 'content': 'say a word'}], [{'role': 'user', 'content': 'ok fine next go'}]]
    solo = [c.chat.completions.create(messages=m, **kw).choices[0].message.content for m in msgs]
    out, go = [None, None], threading.Barrier(2)
    def ask(i):
        go.wait(); out[i] = c.chat.completions.create(messages=msgs[i], **kw).choices[0].message.content
    ts = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in ts: t.start()
    for t in ts: t.join()
    after = _stats(url)
    shared = after['batch_sizes'].get('2', 0) - before['batch_sizes'].get('2', 0)
    assert shared > 0, (before, after)                  # some decode steps ran both requests in one batch
    assert out == solo                                  # greedy: batched answers equal the solo ones


def test_a_client_that_goes_away_frees_its_row(server):
    "The reply would run to the 4096-token context (several seconds); the client leaves after its first chunk."
    url, c = server
    before = _stats(url)['cancelled']
    s = c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'hi'}], stream=True, extra_body={'ignore_eos': True})
    next(iter(s)); s.close()
    t = time.time() + 30
    while _stats(url)['cancelled'] == before and time.time() < t: time.sleep(0.05)
    assert _stats(url)['cancelled'] == before + 1


def test_a_cancelled_row_leaves_the_batch_at_the_next_step(tiny_ckpt):
    "The engine's side of a client going away, without the network's timing: a row cancelled after its first token ends there."
    import queue
    from composer2.serve import Engine, _Seq, load_served
    model, tok = load_served(*tiny_ckpt, device='cpu')
    eng, q = Engine(model, tok, max_batch=4), queue.Queue()
    def emit(e):                  # runs in the engine thread: the row is cancelled as soon as its first token is out
        if e[0] == 'text': long.cancelled = True
        else: q.put(e)
    try:
        gone = _Seq(tok.encode('hi'), 2000, 0.0, 1.0, None, [], True, q.put, cancelled=True)   # left before its prefill
        long = _Seq(tok.encode('hi'), 2000, 0.0, 1.0, None, [], True, emit)
        eng.submit(gone); eng.submit(long)
        e = q.get(timeout=120)
    finally: eng.close()
    assert e[0] == 'done' and e[3] == 2 and gone.tokens == [], e
    assert eng.stats['cancelled'] == 2 and eng.stats['requests'] == 2, eng.stats


@pytest.mark.parametrize('body,status,code', [
    ({'model': 'nope', 'messages': [{'role': 'user', 'content': 'hi'}]}, 404, 'model_not_found'),
    ({'model': 'tiny', 'messages': 'hi'}, 400, None),
    ({'model': 'tiny', 'messages': [{'role': 'wizard', 'content': 'hi'}]}, 400, None),
    ({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'tools': [{'type': 'function'}]}, 400, None),
    ({'model': 'tiny', 'messages': [{'role': 'tool', 'tool_call_id': 'x', 'content': 'r'}]}, 400, None),
    ({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'word ' * 5000}]}, 400, 'context_length_exceeded'),
    ({'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': -1}, 400, None),
])
def test_bad_requests_are_4xx_and_the_server_lives(server, body, status, code):
    import httpx
    url, c = server
    r = httpx.post(url + '/chat/completions', json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()['error']
    assert err['message'] and err['type'] == 'invalid_request_error' and (code is None or err['code'] == code)
    assert httpx.post(url + '/chat/completions', content=b'{oops', timeout=30).status_code == 400
    assert c.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': 'hi'}], max_tokens=2).choices


def test_bench_openai_agent_and_regrade(server, validated_toy, tmp_path):
    from composer2.tasks import save_tasks
    url, _ = server
    save_tasks([validated_toy], tmp_path / 'tasks.jsonl')
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1'}
    out = tmp_path / 'run'
    r = subprocess.run([sys.executable, '-m', 'composer2.cli', 'bench', '--agent', 'openai', '--base-url', url, '--model', 'tiny',
                        '--tasks', str(tmp_path / 'tasks.jsonl'), '--out', str(out), '--max-turns', '3', '--no-quality'],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    eps = [json.loads(l) for l in (out / 'episodes.jsonl').read_text().splitlines()]
    assert eps[0]['tool_calls'] >= 1 and eps[0]['resolved'], eps      # the served model fixed the bug through create_file
    preds = [json.loads(l) for l in (out / 'predictions.jsonl').read_text().splitlines()]
    assert set(preds[0]) == {'instance_id', 'model_name_or_path', 'model_patch'} and preds[0]['model_patch'].startswith('--- a/toymod.py')
    g = subprocess.run([sys.executable, '-m', 'composer2.cli', 'bench', '--grade', str(out / 'predictions.jsonl'), '--tasks',
                        str(tmp_path / 'tasks.jsonl')], env=env, capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    grades = [json.loads(l) for l in (out / 'grades.jsonl').read_text().splitlines()]
    assert [x['resolved'] for x in grades] == [e['resolved'] for e in eps]
    assert json.loads(g.stdout)['resolved'] == 1.0
    # the transcript: a page linked from the report, and `composer2 show`
    name = eps[0]['task_id'] + '__0'
    assert f'(transcripts/{name}.md)' in (out / 'report.md').read_text()
    s = subprocess.run([sys.executable, '-m', 'composer2.cli', 'show', name, '--run', str(out)], env=env, capture_output=True, text=True)
    assert s.returncode == 0 and 'create_file' in s.stdout and 'resolved **True**' in s.stdout


def test_compiled_engine_answers_as_the_eager_one(tiny_ckpt):
    "`serve --compile`: the engine's compiled decode steps give the eager engine's greedy answers, requests batched together."
    import queue
    from composer2.serve import Engine, _Seq, load_served
    model, tok = load_served(*tiny_ckpt, device='cpu')
    prompts = [tok.encode(p) for p in ('say a word', 'ok fine next go', 'go')]
    answers = {}
    for comp in (False, True):
        eng, q = Engine(model, tok, max_batch=4, compile=comp), queue.Queue()
        try:
            seqs = [_Seq(p, 24, 0.0, 1.0, None, [], True, lambda e, i=i: e[0] != 'text' and q.put((i, e))) for i, p in enumerate(prompts)]
            for s in seqs: eng.submit(s)
            done = dict(q.get(timeout=300) for _ in seqs)
        finally: eng.close()
        assert all(e[0] == 'done' and e[3] == 24 for e in done.values()), done
        answers[comp] = [seqs[i].tokens for i in range(len(seqs))]
    assert answers[True] == answers[False]
