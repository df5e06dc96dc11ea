"""Speculative decoding with MTP drafts: exact greedy equivalence, exact sampling distribution, cache rollback."""
import itertools, tempfile

import numpy as np
import pytest
import torch
from scipy import stats

from composer2.decoding import KVCache
from composer2.model import ModelConfig, Transformer
from composer2.decoding import generate
from composer2.mtp import MTPHeads, MTPTrainConfig, train_mtp
from composer2.speculative import speculative_generate, verify_greedy, verify_sampling, warp
from composer2.train import TrainConfig, WindowSampler, train
from conftest import cycle_stream, mtp_cfg as tiny_cfg


@pytest.fixture(scope='module')
def trained():
    "A tiny model and 3 MTP depths self-distilled on a repetitive stream: most drafts are accepted."
    torch.manual_seed(0)
    stream = cycle_stream(noise=0.02)
    m = Transformer(tiny_cfg())
    with tempfile.TemporaryDirectory() as d:
        train(m, TrainConfig(steps=60, batch_size=8, seq_len=32, warmup_steps=3, lr=1e-2, log_every=1000), WindowSampler(stream, 32, 8), d)
    m.eval()
    h = MTPHeads(m.cfg, depth=3)
    train_mtp(m, h, WindowSampler(stream, 32, 8, seed=1), MTPTrainConfig(steps=60, seq_len=32, warmup_steps=3, lr=1e-2))
    return m, h, stream


PROMPTS = [[1, 2, 3], [5] * 9, list(range(10, 30)), [63]]
TIE = 1e-4      # top-2 logit gap below which two code paths may legitimately pick different argmaxes


def near_tie(logits, tol=TIE) -> bool:
    top = logits.float().topk(2).values
    return float(top[0] - top[1]) < tol


def assert_greedy_same(m, prompts, got, ref, tol=TIE):
    """Greedy outputs of two code paths: speculative verification runs the main model over K+1 tokens at once, plain
    decoding over one, batched or not, so their logits differ in the last bits (different shapes and reductions).
    Each row must be identical, or first differ where the main model's top-2 logits are within `tol` (a near-tie,
    where either argmax is a correct greedy step)."""
    for p, a, b in zip(prompts, got, ref):
        if a == b: continue
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.no_grad(): lg = m(torch.tensor([p + b[:j]])).logits[0, -1]
        assert near_tie(lg, tol), f"rows differ at new token {j} without a near-tie: {a} vs {b}"


@pytest.mark.numerics
@pytest.mark.parametrize('moe', [False, True])
def test_greedy_equals_plain_random_model(moe):
    torch.manual_seed(1)
    m = Transformer(tiny_cfg()).eval(); h = MTPHeads(m.cfg, depth=3, moe=moe).eval()
    ref = generate(m, PROMPTS, 24)
    for K in (1, 2, 3):
        sg = speculative_generate(m, h, PROMPTS, 24, draft_len=K)
        assert_greedy_same(m, PROMPTS, sg.tokens, ref.tokens)
        assert sum(sg.n_verify) >= sum(len(t) - 1 for t in ref.tokens) / (K + 1)
    assert sg.stats()['tokens_per_verify'] < 1.5          # random heads: almost nothing accepted


@pytest.mark.numerics
def test_greedy_equals_plain_trained_model(trained):
    m, h, stream = trained
    rand = np.random.default_rng(0).integers(0, 64, 12).tolist()
    prompts = [stream[:5].tolist(), stream[3:20].tolist(), rand, stream[100:101].tolist()]
    ref = generate(m, prompts, 40)
    for K in (1, 2, 3):
        sg = speculative_generate(m, h, prompts, 40, draft_len=K, trace=True)
        assert_greedy_same(m, prompts, sg.tokens, ref.tokens)
    st = sg.stats()
    assert st['tokens_per_verify'] > 2.5 and st['acceptance_per_depth'][0] > 0.8
    # untrained heads on the same model: partial acceptance, and rows accept different numbers of drafts in the
    # same verify step; still the plain output, also row by row against unbatched decoding
    sg = speculative_generate(m, MTPHeads(m.cfg, depth=3), prompts, 40, draft_len=3, trace=True)
    assert_greedy_same(m, prompts, sg.tokens, ref.tokens)
    steps = min(len(t) for t in sg.trace)
    assert sum(len({t[j][2] for t in sg.trace}) > 1 for j in range(steps)) >= 3
    for p, t in zip(prompts, sg.tokens): assert_greedy_same(m, [p], [t], generate(m, [p], 40).tokens)


@pytest.mark.numerics
def test_greedy_eos_and_lengths(trained):
    m, h, stream = trained
    prompts = [stream[:6].tolist(), stream[2:9].tolist()]
    ref = generate(m, prompts, 30, eos_id=int(stream[10]))
    sg = speculative_generate(m, h, prompts, 30, draft_len=3, eos_id=int(stream[10]))
    assert_greedy_same(m, prompts, sg.tokens, ref.tokens)
    assert all(t[-1] == int(stream[10]) for t in sg.tokens)
    for n in (1, 2, 5, 7):
        assert [len(t) for t in speculative_generate(m, h, prompts, n, draft_len=3).tokens] == [n, n]


@pytest.mark.numerics
def test_drafts_match_teacher_forced_mtp(trained):
    "Every draft whose earlier drafts were accepted equals the teacher-forced MTP argmax on the final sequence: the MTP caches hold exactly the committed entries."
    m, h, stream = trained
    prompts = [stream[:5].tolist(), [3, 1, 4, 1, 5, 9, 2, 6]]
    sg = speculative_generate(m, h, prompts, 30, draft_len=3, trace=True)
    checked = 0
    for p, toks, tr in zip(prompts, sg.tokens, sg.trace):
        full = torch.tensor([p + toks])
        with torch.no_grad():
            lg, _ = h(m, full, m(full, return_hidden=True).hidden)
        for N, drafts, a in tr:
            for k in range(1, min(a + 1, 3) + 1):           # depth k saw only accepted (true) tokens
                if N - 1 + k + 1 >= full.shape[1]: break   # the final sequence was cut at max_new_tokens
                # cached incremental drafts vs one teacher-forced pass (different shapes): equal argmax unless near a tie
                assert drafts[k - 1] == int(lg[k - 1][0, N - 1].argmax()) or near_tie(lg[k - 1][0, N - 1]), (N, k)
                checked += 1
    assert checked > 20


def test_cache_rollback_matches_fresh_forward():
    "Feed junk drafts, roll the cache back, continue: logits equal a fresh forward over the true sequence."
    torch.manual_seed(2)
    m = Transformer(tiny_cfg()).eval()
    seq = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = m(seq).logits
        c = KVCache.for_model(m, 2, 32)
        m(seq[:, :6], cache=c)
        m(torch.cat([seq[:, 6:7], torch.randint(0, 64, (2, 3))], 1), cache=c)   # one true token + 3 junk drafts
        assert c.lengths.tolist() == [10, 10]
        c.truncate(torch.tensor([7, 7]))
        out = m(seq[:, 7:], cache=c)
        assert torch.allclose(out.logits, ref[:, 7:], atol=1e-5)
        c.truncate(torch.tensor([8, 12]))                      # rows roll back by different amounts
        out = m(torch.stack([seq[0, 8:10], torch.randint(0, 64, (2,))]), cache=c, input_lens=torch.tensor([2, 1]))
        assert torch.allclose(out.logits[0], ref[0, 8:10], atol=1e-5)
    with pytest.raises(ValueError, match='shorten'): c.truncate(torch.tensor([20, 20]))


def test_verify_greedy():
    L = torch.full((3, 3, 5), -5.0)
    for b, row in enumerate([[1, 2, 3], [4, 0, 0], [2, 2, 2]]):
        for j, t in enumerate(row): L[b, j, t] = 5.0
    n, nxt = verify_greedy(L, torch.tensor([[1, 2], [4, 1], [0, 2]]))
    assert n.tolist() == [2, 1, 0] and nxt.tolist() == [3, 0, 2]
    with pytest.raises(ValueError): verify_greedy(L, torch.zeros(3, 3, dtype=torch.long))


def _chi2_p(counts, probs):
    "p-value of a chi-square goodness-of-fit test, cells with tiny expectation pooled."
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    exp = probs * counts.sum()
    big = exp >= 5
    c = np.append(counts[big], counts[~big].sum()); e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    if c[~keep].sum() > 0: return 0.0                      # mass where the target has none
    c, e = c[keep], e[keep]
    return stats.chisquare(c, e * c.sum() / e.sum()).pvalue


V = 6
def _dist(seed, peaky=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * peaky).softmax(-1)

CASES = {
    'q_equals_p': lambda p1, p2: (p1.clone(), p2.clone()),
    'disjoint': lambda p1, p2: (torch.tensor([0, 0, 0, 0, .5, .5]), torch.tensor([0, 0, 0, 0, .3, .7])),
    'one_hot': lambda p1, p2: (torch.eye(V)[int(p1.argmax())], torch.eye(V)[1]),
    'random': lambda p1, p2: (_dist(11), _dist(12)),
}

@pytest.mark.parametrize('case', list(CASES))
def test_verify_sampling_preserves_target(case):
    "With two drafts: the first emitted token ~ p1, the second (when emitted) ~ p2; acceptance of draft 1 = sum min(p1, q1)."
    n_rows = 40000
    p1 = torch.tensor([.4, .3, .2, .1, 0, 0]) if case == 'disjoint' else _dist(1)
    p2, p3 = _dist(2), _dist(3)
    q1, q2 = CASES[case](p1, p2)
    g = torch.Generator().manual_seed(0)
    d = torch.stack([torch.multinomial(q1, n_rows, replacement=True, generator=g),
                     torch.multinomial(q2, n_rows, replacement=True, generator=g)], 1)
    P = torch.stack([p1, p2, p3])[None].expand(n_rows, 3, V)
    Q = torch.stack([q1, q2])[None].expand(n_rows, 2, V)
    n, nxt = verify_sampling(P, Q, d, g)
    first = torch.where(n >= 1, d[:, 0], nxt)
    assert _chi2_p(np.bincount(first.numpy(), minlength=V), p1.numpy()) > 1e-3
    has2 = n >= 1
    second = torch.where(n[has2] >= 2, d[has2, 1], nxt[has2])
    if int(has2.sum()) > 1000: assert _chi2_p(np.bincount(second.numpy(), minlength=V), p2.numpy()) > 1e-3
    acc = float((n >= 1).float().mean()); expect = float(torch.minimum(p1, q1).sum())
    assert abs(acc - expect) < 4 * np.sqrt(expect * (1 - expect) / n_rows) + 1e-9
    if case == 'q_equals_p': assert bool((n == 2).all())
    if case == 'disjoint': assert bool((n == 0).all())


def test_chi2_helper_detects_a_wrong_distribution():
    "The statistical test can fail: samples from q are rejected as samples of p."
    g = torch.Generator().manual_seed(0)
    p, q = _dist(1), _dist(11)
    s = torch.multinomial(q, 40000, replacement=True, generator=g)
    assert _chi2_p(np.bincount(s.numpy(), minlength=V), p.numpy()) < 1e-6


def _exact_seq_probs(m, prompt, n, temperature):
    "Exact probability of every length-n continuation under plain sampling at `temperature`, by enumeration."
    seqs = torch.tensor(list(itertools.product(range(m.cfg.vocab_size), repeat=n)))
    full = torch.cat([torch.tensor(prompt)[None].expand(len(seqs), -1), seqs], 1)
    with torch.no_grad(): lp = (m(full).logits / temperature).log_softmax(-1)
    L = len(prompt)
    tot = sum(lp[:, L - 1 + j].gather(-1, seqs[:, j:j + 1])[:, 0] for j in range(n))
    return seqs, tot.exp()


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_speculative_sampling_matches_exact_distribution(temperature):
    "End to end, batched: 3-token continuations of speculative sampling follow the exact plain-sampling distribution (chi-square over all 216 sequences)."
    torch.manual_seed(3)
    m = Transformer(tiny_cfg(vocab=V, init_std=0.4)).eval()
    h = MTPHeads(m.cfg, depth=2).eval()
    for p in h.parameters(): p.data.mul_(10)                    # heads whose drafts are often wrong
    prompt, n, rows = [1, 4, 2], 3, 12000
    seqs, probs = _exact_seq_probs(m, prompt, n, temperature)
    assert abs(float(probs.sum()) - 1) < 1e-4
    g = torch.Generator().manual_seed(5)
    sg = speculative_generate(m, h, [prompt] * rows, n, draft_len=2, temperature=temperature, generator=g)
    code = lambda toks: sum(t * V ** (n - 1 - j) for j, t in enumerate(toks))
    counts = np.bincount([code(t) for t in sg.tokens], minlength=V ** n)
    assert _chi2_p(counts, probs.numpy()) > 1e-3
    st = sg.stats()
    assert 0.05 < st['acceptance_per_depth'][0] < 0.95       # both acceptance and rejection happen
    plain = generate(m, [prompt] * rows, n, temperature=temperature, generator=torch.Generator().manual_seed(6))
    assert _chi2_p(np.bincount([code(t) for t in plain.tokens], minlength=V ** n), probs.numpy()) > 1e-3


def test_speculative_sampling_top_p_support():
    "Nucleus sampling: no token outside the target's top-p set is ever emitted."
    torch.manual_seed(4)
    m = Transformer(tiny_cfg(vocab=V, init_std=0.4)).eval(); h = MTPHeads(m.cfg, depth=2).eval()
    g = torch.Generator().manual_seed(0)
    sg = speculative_generate(m, h, [[1, 2]] * 3000, 1, draft_len=2, temperature=1.0, top_p=0.6, generator=g)
    with torch.no_grad(): allowed = warp(m(torch.tensor([[1, 2]])).logits[0, -1], 1.0, 0.6) > 0
    assert all(bool(allowed[t[0]]) for t in sg.tokens)


def test_bad_arguments():
    m = Transformer(tiny_cfg()).eval(); h = MTPHeads(m.cfg, depth=2)
    with pytest.raises(ValueError, match='draft_len'): speculative_generate(m, h, [[1]], 4, draft_len=3)
    with pytest.raises(ValueError, match='non-empty'): speculative_generate(m, h, [[]], 4)
    with pytest.raises(ValueError, match='d_model'): speculative_generate(m, MTPHeads(tiny_cfg(d_model=64, n_heads=2)), [[1]], 4)
