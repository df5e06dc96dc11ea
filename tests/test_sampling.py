"""`composer2.decoding.sample_from` / `sample_next` against torch.multinomial (the sampler it replaced) and against
the probabilities themselves: same distribution, zero-probability tokens never drawn, the end of the row guarded."""
import pytest, torch
from composer2.decoding import sample_from, sample_next

pytestmark = pytest.mark.numerics

def _freq(t, V): return torch.bincount(t, minlength=V).double() / t.numel()

def test_frequencies_match_multinomial_and_probabilities():
    g = torch.Generator().manual_seed(0)
    V, N = 12, 40_000
    p = torch.rand(V, generator=g) ** 3; p[[2, 7, 11]] = 0                      # zero-mass tokens, one at the end
    p /= p.sum()
    ours = sample_from(p.expand(N, V), torch.Generator().manual_seed(1))
    ref = torch.multinomial(p.expand(N, V), 1, generator=torch.Generator().manual_seed(2))[:, 0]
    se = (p * (1 - p) / N).sqrt()
    fo, fr = _freq(ours, V), _freq(ref, V)
    assert ((fo - p).abs() <= 4.5 * se + 1e-12).all(), (fo, p)                   # 4.5 standard errors per token
    assert ((fo - fr).abs() <= 4.5 * (2 ** 0.5) * se + 1e-12).all(), (fo, fr)
    assert fo[[2, 7, 11]].sum() == 0

def test_unnormalised_rows_and_batch_independence():
    probs = torch.tensor([[0., 3., 0., 1.], [5., 0., 0., 0.], [0., 0., 0., 2e-30]])
    toks = torch.stack([sample_from(probs, torch.Generator().manual_seed(s)) for s in range(200)])
    assert (toks[:, 1] == 0).all() and (toks[:, 2] == 3).all()
    assert set(toks[:, 0].tolist()) == {1, 3}

def test_a_uniform_of_one_stays_inside_the_row(monkeypatch):
    "A generator returning 1.0 would put u at the row's total: the clamp keeps the draw on the last token with mass."
    real = torch.rand
    monkeypatch.setattr(torch, 'rand', lambda *a, **k: real(*a, **k).fill_(1.0))
    probs = torch.tensor([[1., 2., 0., 0.], [0., 0., 0.3, 0.], [0.25, 0.25, 0.25, 0.25]])
    assert sample_from(probs).tolist() == [1, 2, 3]

def test_sample_next_logprobs_and_errors():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    tok, lp = sample_next(logits, 0.7, 0.9, torch.Generator().manual_seed(4))
    ref = (logits / 0.7).log_softmax(-1).gather(-1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)
    with pytest.raises(ValueError, match=r'rows \[1\]'):
        sample_next(torch.tensor([[0.0, 1.0], [float('-inf'), float('-inf')]]), 1.0)

def _nucleus_by_sort(p, top_p):
    sp, si = p.sort(-1, descending=True)
    return torch.zeros_like(p).scatter_(-1, si, sp * (sp.cumsum(-1) - sp < top_p))

@pytest.mark.parametrize('V', [64, 4096, 32000])
def test_top_p_filter_equals_a_full_sort(V):
    "Flat and peaked rows in one batch: the partial selection serves the peaked ones, the sort the others."
    from composer2.decoding import top_p_filter
    g = torch.Generator().manual_seed(V)
    probs = torch.cat([(torch.randn(4, V, generator=g) * s).softmax(-1) for s in (0.5, 2, 6, 12)])
    probs[3] = 0; probs[3, 5] = 1.0                                             # a one-token row
    for top_p in (0.05, 0.5, 0.9, 0.95, 0.999, 1 - 1e-7):
        assert torch.equal(top_p_filter(probs, top_p), _nucleus_by_sort(probs, top_p)), top_p

def test_top_p_out_of_range_is_refused():
    from composer2.rl_rollout import sample_coupled
    for bad in (0.0, -0.5, 1.5, float('nan')):
        with pytest.raises(ValueError, match='top_p must be in'): sample_next(torch.zeros(2, 8), 1.0, bad)
        with pytest.raises(ValueError, match='top_p must be in'): sample_coupled(torch.zeros(2, 8), 1.0, bad, [torch.Generator()] * 2)

def test_top_p_filter_sorts_only_the_rows_that_need_it(monkeypatch):
    from composer2.decoding import top_p_filter
    sorted_rows, real_sort = [], torch.Tensor.sort
    def spy(self, *a, **k): sorted_rows.append(self.shape[0]); return real_sort(self, *a, **k)
    monkeypatch.setattr(torch.Tensor, 'sort', spy)
    g = torch.Generator().manual_seed(0)
    probs = torch.cat([(torch.randn(6, 4096, generator=g) * s).softmax(-1) for s in (0.5, 12)])   # 6 flat, 6 peaked
    out = top_p_filter(probs, 0.9)
    assert sorted_rows == [6]                         # the flat rows only
    monkeypatch.setattr(torch.Tensor, 'sort', real_sort)
    assert torch.equal(out, _nucleus_by_sort(probs, 0.9))
