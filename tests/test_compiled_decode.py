"Compiled decoding (`composer2.decoding.compiled_step`) against the eager decode step and plain generation."
import pytest, torch
from conftest import tiny_cfg
from composer2.decoding import KVCache, compiled_step, generate
from composer2.model import Transformer

TOL = 1e-4      # max |logit difference|: the compiled MoE branch sums its experts in another order than the eager one


def model(**kw):
    torch.manual_seed(0); return Transformer(tiny_cfg(**kw)).eval()


def steps_both(m, prompts, n, cap=40):
    "Decode `n` greedy steps from the same prefill with the eager step and with `compiled_step`; yields logits pairs."
    lens = torch.tensor([len(p) for p in prompts]); P = int(lens.max())
    ids = torch.tensor([p + [0] * (P - len(p)) for p in prompts])
    ce, cc = KVCache.for_model(m, len(prompts), cap), KVCache.for_model(m, len(prompts), cap)
    with torch.no_grad():
        last = m(ids, cache=ce, input_lens=lens, logits_at=lens - 1).logits[:, 0]
        m(ids, cache=cc, input_lens=lens)
        for _ in range(n):
            tok = last.argmax(-1)
            e, c = m(tok[:, None], cache=ce, stats=False).logits[:, -1], compiled_step(m, tok, cc)
            yield e, c, ce, cc
            last = e


@pytest.mark.numerics
@pytest.mark.parametrize('kw', [{}, dict(qk_norm=True, qkv_bias=True, head_size=12, shared_gate=True, router='sigmoid')])
def test_compiled_steps_agree_with_eager_steps(kw):
    m = model(**kw)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16]]
    for e, c, ce, cc in steps_both(m, prompts, 10):
        assert (e - c).abs().max() < TOL
        assert torch.equal(ce.lengths, cc.lengths)
    for a, b in zip(ce.k + ce.v, cc.k + cc.v): torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert cc.uniform() is None and ce.uniform() is None          # rows of different lengths, after static steps too


def test_compiled_generate_matches_plain_greedy_where_margins_allow():
    m = model(); g = torch.Generator().manual_seed(3)
    for prompts in ([torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 4, 11, 6)],):
        a, b = generate(m, prompts, max_new_tokens=14), generate(m, prompts, max_new_tokens=14, compile=True)
        for p, ta, tb in zip(prompts, a.tokens, b.tokens):
            if ta == tb: continue
            j = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)   # a flip is allowed only at a near tie
            with torch.no_grad(): top = m(torch.tensor([p + ta[:j]])).logits[0, -1].topk(2).values
            assert float(top[0] - top[1]) < 2 * TOL, (p, j)


def test_compiled_step_follows_new_weights_and_other_models():
    m, m2 = model(), model()
    with torch.no_grad():
        for p in m2.parameters(): p.mul_(1.5)
    c = KVCache.for_model(m, 2, 16); m(torch.tensor([[1, 2], [3, 4]]), cache=c)
    tok = torch.tensor([5, 6])
    for mod in (m, m2, m):       # same shapes, other weights: each call reads the weights it is given
        cc = c.clone()
        with torch.no_grad(): ref = mod(tok[:, None], cache=c.clone(), stats=False).logits[:, -1]
        assert (compiled_step(mod, tok, cc) - ref).abs().max() < TOL


def test_bf16_model_with_its_fp32_cache():
    m = model().to(torch.bfloat16)
    c = KVCache.for_model(m, 2, 16); assert c.k[0].dtype == torch.float32
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3], [4, 5, 6]]), cache=c)
        tok = torch.tensor([7, 8]); ref = m(tok[:, None], cache=c.clone(), stats=False).logits[:, -1].float()
        out = compiled_step(m, tok, c).float()
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 0.05 * ref.abs().max()   # bf16 rounding of two orders


def test_bad_tokens_full_cache_and_routes_are_refused():
    m = model(); c = KVCache.for_model(m, 2, 16)       # the shapes of the test above: its graph is reused
    m(torch.arange(30).view(2, 15), cache=c, input_lens=torch.tensor([15, 9]))
    with pytest.raises(ValueError, match='token ids'): compiled_step(m, torch.tensor([97, 1]), c)
    with pytest.raises(ValueError, match='token ids'): compiled_step(m, torch.tensor([-1, 1]), c)
    compiled_step(m, torch.tensor([4, 4]), c); assert c.lengths.tolist() == [16, 10]
    with pytest.raises(ValueError, match='overflow'): compiled_step(m, torch.tensor([5, 5]), c)
    assert c.lengths.tolist() == [16, 10]                         # a refused step changes nothing
    with pytest.raises(ValueError, match='routes'): generate(m, [[1]], 2, return_routes=True, compile=True)


def test_shapes_beyond_dynamos_graph_limit_run_the_eager_step(monkeypatch):
    import composer2.decoding as D
    m = model(); c = KVCache.for_model(m, 2, 16); m(torch.tensor([[1, 2], [3, 4]]), cache=c)
    monkeypatch.setattr(D, '_SEEN', set(range(torch._dynamo.config.recompile_limit)))   # as if 8 graphs were built
    tok = torch.tensor([5, 6])
    with torch.no_grad(): ref = m(tok[:, None], cache=c.clone(), stats=False).logits[:, -1]
    assert torch.equal(compiled_step(m, tok, c), ref) and c.lengths.tolist() == [3, 3]


def test_a_new_thread_count_compiles_rather_than_failing():
    """Dynamo guards its graphs on the thread count (among its global state): a step compiled under 2 threads and called
    under 1 must compile again, not enter the old graph with its guards skipped (that raised a RuntimeError)."""
    m, n = model(), torch.get_num_threads()
    prompts = [[1, 2, 3], [4, 5]]
    ref = generate(m, prompts, max_new_tokens=6)
    try:
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            got = generate(m, prompts, max_new_tokens=6, compile=True)
            assert got.tokens == ref.tokens
            assert max(abs(a - b) for r, s in zip(got.logprobs, ref.logprobs) for a, b in zip(r, s)) < TOL
    finally: torch.set_num_threads(n)


def test_both_graph_keys_tell_thread_counts_apart():
    "The key's global state: dynamo's guard string where torch has it (chosen once at import), else the fallback tuple."
    from composer2 import decoding as D
    assert D._global_state is D._dynamo_state       # the pinned torch has the guard
    n = torch.get_num_threads(); a = D._dynamo_state(), D._fallback_state()
    torch.set_num_threads(1 if n > 1 else 2)
    try: b = D._dynamo_state(), D._fallback_state()
    finally: torch.set_num_threads(n)
    assert a[0] != b[0] and a[1] != b[1] and (D._dynamo_state(), D._fallback_state()) == a
