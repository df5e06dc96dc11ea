"The MoE transformer: route observation/forcing, KV cache, generation."
import pytest, torch
import torch.nn.functional as F
from conftest import tiny_cfg
from composer2.decoding import KVCache
from composer2.model import MoE, Transformer
from composer2.decoding import generate

def model(**kw):
    torch.manual_seed(0); return Transformer(tiny_cfg(**kw)).eval()

@pytest.mark.parametrize('kw', [{}, {'router': 'sigmoid'}, {'n_shared_experts': 0, 'norm_topk': False}, {'n_dense_layers': 1}])
def test_forcing_own_routes_reproduces_logits_and_others_change_them(kw):
    m = model(**kw); ids = torch.randint(0, 97, (3, 17))
    out = m(ids, return_routes=True)
    assert out.routes.shape == (m.cfg.n_moe_layers, 3, 17, 2) and out.routes.dtype == torch.long
    # exact: the same batch through the same kernels, only where the expert ids come from differs
    assert torch.equal(m(ids, routes=out.routes).logits, out.logits)
    other = out.routes.flip(-1).clone(); other[..., 0] = (other[..., 0] + 1) % 4
    other[..., 1] = torch.where(other[..., 1] == other[..., 0], (other[..., 1] + 1) % 4, other[..., 1])
    assert (m(ids, routes=other).logits - out.logits).abs().max() > 1e-4

def test_forced_routes_still_train_the_router():
    m = model().train(); ids = torch.randint(0, 97, (2, 9))
    r = m(ids, return_routes=True).routes
    m(ids, routes=r).logits.logsumexp(-1).mean().backward()
    for layer in m.layers: assert layer.ffn.router.weight.grad.abs().sum() > 0

def test_bad_routes_are_rejected():
    m = model(); ids = torch.randint(0, 97, (1, 5))
    r = m(ids, return_routes=True).routes
    with pytest.raises(ValueError, match='outside'): m(ids, routes=r + 10)
    with pytest.raises(ValueError, match='MoE layers'): m(ids, routes=r[:1])
    with pytest.raises(ValueError, match='token ids'): m(torch.tensor([[200]]))

@pytest.mark.numerics
def test_moe_equals_naive_per_token_loop():
    torch.manual_seed(1); cfg = tiny_cfg(n_shared_experts=0); moe = MoE(cfg)
    x = torch.randn(2, 7, 32); y, st = moe(x)
    s = moe.scores(x); ref = torch.zeros_like(x)
    for b in range(2):
        for t in range(7):
            g = s[b, t, st.routes[b, t]]; g = g / g.sum()
            for j, e in enumerate(st.routes[b, t].tolist()):
                ref[b, t] += g[j] * (F.silu(x[b, t] @ moe.w1[e].t()) * (x[b, t] @ moe.w3[e].t())) @ moe.w2[e].t()
    # toleranced: grouped GEMMs over sorted rows vs per-token vector products sum in different orders
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-5)

def greedy_uncached(m, prompt, n):
    seq = list(prompt)
    for _ in range(n): seq.append(int(m(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]

@pytest.mark.numerics      # argmax over logits from two code paths (cached batched decode vs full forward): a near tie could flip
def test_cached_greedy_equals_uncached_argmax_loop_batched():
    m = model(); g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (1, 4, 11, 6)]
    out = generate(m, prompts, max_new_tokens=12)
    for p, t in zip(prompts, out.tokens): assert t == greedy_uncached(m, p, 12)

@pytest.mark.numerics
def test_cache_matches_full_forward_and_rolls_back():
    m = model(); ids = torch.randint(0, 97, (2, 10))
    full = m(ids).logits
    c = KVCache.for_model(m, 2, 32)
    a = m(ids[:, :6], cache=c).logits; b = m(ids[:, 6:], cache=c).logits
    # toleranced: cached attention over [B, T_new, L] blocks vs one causal SDPA over the whole sequence (other shapes)
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-4)
    c.truncate([6, 6]); b2 = m(ids[:, 6:], cache=c).logits          # roll back and replay
    torch.testing.assert_close(b2, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match='shorten'): c.truncate([20, 20])

def test_padded_positions_carry_no_routes_and_eos_stops():
    m = model(); ids = torch.randint(0, 97, (2, 6))
    c = KVCache.for_model(m, 2, 16)
    out = m(ids, cache=c, input_lens=torch.tensor([6, 3]), return_routes=True)
    assert (out.routes[:, 1, 3:] == -1).all() and (out.routes[:, 0] >= 0).all() and c.lengths.tolist() == [6, 3]
    first = generate(m, [[1, 2, 3]], max_new_tokens=5).tokens[0][0]
    assert generate(m, [[1, 2, 3]], max_new_tokens=5, eos_id=first).tokens[0] == [first]

@pytest.mark.numerics      # routes are top-k of router scores computed on two code paths (batched cached decode vs full forward)
def test_generated_routes_and_logprobs_replay_the_training_forward():
    m = model(); prompts = [[1, 2, 3, 4], [5, 6]]
    g = generate(m, prompts, max_new_tokens=5, temperature=1.0, generator=torch.Generator().manual_seed(0), return_routes=True)
    for i, (p, t, r) in enumerate(zip(prompts, g.tokens, g.routes)):
        seq = torch.tensor([p + t]); out = m(seq, return_routes=True)
        assert r.dtype == torch.uint8 and torch.equal(out.routes[:, 0], r.long())
        lp = out.logits[0, len(p) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(t)[:, None])[:, 0]
        # toleranced: sampling-time log-probs come from the cached, padded batch of both prompts
        torch.testing.assert_close(lp, torch.tensor(g.logprobs[i]), atol=1e-4, rtol=1e-4)

# --- the MoE layer's fast path (fused w13, grouped_mm, gather dispatch/combine) against independent references ---
from composer2.model import balance_loss, combine, dispatch, expert_ffn, route

def _per_expert_loop(moe, x, idx, gates):
    "Reference: for each expert, its tokens through separate w1/w3/w2 matmuls, scatter-added with the gates."
    xf, k, out = x.reshape(-1, x.shape[-1]), idx.shape[-1], torch.zeros(x.shape[:-1].numel(), x.shape[-1], dtype=torch.float64)
    w1, w3, w2 = (w.detach().double() for w in (moe.w1, moe.w3, moe.w2))
    for e in range(moe.cfg.n_experts):
        t, j = (idx.reshape(-1, k) == e).nonzero(as_tuple=True)
        if len(t) == 0: continue
        xe = xf[t].double()
        out.index_add_(0, t, (F.silu(xe @ w1[e].t()) * (xe @ w3[e].t())) @ w2[e].t() * gates.reshape(-1, k)[t, j, None].double())
    return out.view(x.shape)

@pytest.mark.parametrize("E,k,n", [(8, 2, 300), (16, 4, 257), (6, 3, 2), (4, 2, 1)])   # also decode-sized
def test_grouped_dispatch_equals_per_expert_loop(E, k, n):
    torch.manual_seed(E + n); cfg = tiny_cfg(n_experts=E, top_k=k, n_shared_experts=0); moe = MoE(cfg)
    x = torch.randn(1, n, cfg.d_model)
    y, st = moe(x)
    s = moe.scores(x); g = s.gather(-1, st.routes); g = g / g.sum(-1, keepdim=True)
    # toleranced: fp32 grouped GEMMs in another summation order than the fp64 reference
    torch.testing.assert_close(y.double(), _per_expert_loop(moe, x, st.routes, g), atol=2e-6, rtol=1e-4)

def test_grouped_path_gradients_equal_per_expert_loop():
    torch.manual_seed(3); cfg = tiny_cfg(n_experts=8, top_k=2, n_shared_experts=0); moe = MoE(cfg)
    x = torch.randn(2, 40, cfg.d_model, requires_grad=True); gout = torch.randn(2, 40, cfg.d_model)
    s, idx, gates = (t.detach() for t in route(moe, x))
    xs, counts, order, tok = dispatch(x, idx, cfg.n_experts)
    (combine(expert_ffn(xs, moe.w13, moe.w2, counts), gates, order, x) * gout).sum().backward()
    x2 = x.detach().double().requires_grad_(); w13 = moe.w13.detach().double().requires_grad_(); w2 = moe.w2.detach().double().requires_grad_()
    h, ref = cfg.d_expert, torch.zeros(80, cfg.d_model, dtype=torch.float64)
    for e in range(8):                                     # the per-expert loop, in float64, with autograd
        t, j = (idx.reshape(-1, 2) == e).nonzero(as_tuple=True)
        xe = x2.reshape(-1, cfg.d_model)[t]
        ye = (F.silu(xe @ w13[e, :h].t()) * (xe @ w13[e, h:].t())) @ w2[e].t()
        ref = ref.index_add(0, t, ye * gates.reshape(-1, 2)[t, j, None].double())
    (ref.view(2, 40, -1) * gout.double()).sum().backward()
    for a, b in [(x.grad, x2.grad), (moe.w13.grad, w13.grad), (moe.w2.grad, w2.grad)]:
        torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-4)

@pytest.mark.parametrize("T", [1, 2, 33])          # decode-sized and prefill-sized batches
def test_forced_routes_bit_exact_small_and_large_batches(T):
    m = model(); ids = torch.randint(0, 97, (1, T))
    out = m(ids, return_routes=True)
    assert torch.equal(m(ids, routes=out.routes).logits, out.logits)

def test_balance_loss_equals_one_hot_reference():
    torch.manual_seed(0); E, k = 8, 3
    s = torch.rand(2, 50, E).softmax(-1); idx = torch.rand(2, 50, E).topk(k, -1).indices
    valid = torch.rand(2, 50) > 0.3
    counts, loss = balance_loss(s, idx, valid)
    m = valid.reshape(-1, 1).double()
    onehot = F.one_hot(idx.reshape(-1, k), E).sum(1).double() * m      # the [N, k, E] one-hot formulation
    frac = onehot.sum(0) / (m.sum() * k); sp = s.reshape(-1, E).double()
    prob = (sp / sp.sum(-1, keepdim=True) * m).sum(0) / m.sum()
    assert torch.equal(counts, onehot.sum(0).float())                   # integer counts: exact
    torch.testing.assert_close(loss.double(), E * (frac * prob).sum(), atol=0, rtol=1e-6)

def test_old_w1_w3_checkpoint_loads_to_identical_outputs():
    m = model(); ids = torch.randint(0, 97, (2, 11))
    old = {}
    for n, v in m.state_dict().items():                 # what a checkpoint of the unfused layer held
        if n.endswith('.w13'):
            h = v.shape[1] // 2; old[n[:-3] + 'w1'], old[n[:-3] + 'w3'] = v[:, :h].clone(), v[:, h:].clone()
        else: old[n] = v.clone()
    assert not any(n.endswith('w13') for n in old)
    m2 = Transformer(m.cfg).eval(); m2.load_state_dict(old, strict=True)
    assert torch.equal(m2(ids).logits, m(ids).logits)


@pytest.mark.numerics
def test_inference_path_follows_fused_optimizer_steps():
    "The no-autograd path (transposed weights) must see every training step, also a fused AdamW's (no version bump)."
    from composer2.model import ModelConfig, frozen_weights
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, d_expert=16,
                      max_seq_len=32)
    m = Transformer(cfg); ids = torch.randint(0, 61, (2, 9))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        with torch.no_grad(): m(ids, stats=False); generate(m, [[1, 2, 3]], max_new_tokens=2)   # would fill a cache
        m(ids).logits.sum().backward(); opt.step(); opt.zero_grad()
        ref = m(ids).logits.detach()                                   # autograd path: the live weights
        with torch.no_grad():
            assert torch.allclose(m(ids).logits, ref, atol=1e-5)
            assert torch.allclose(m(ids, stats=False).logits, ref, atol=1e-5)
            with frozen_weights(m): assert torch.allclose(m(ids, stats=False).logits, ref, atol=1e-5)


def test_kv_cache_writes_each_row_at_its_offset_and_takes_rows_apart():
    torch.manual_seed(0)
    c = KVCache(2, 3, 2, 16, 4); c.lengths = torch.tensor([0, 5, 9])
    k, v = torch.randn(3, 2, 3, 4), torch.randn(3, 2, 3, 4)
    c.write(1, k, v, c.lengths)
    ref = torch.zeros(3, 2, 16, 4)
    for b, s in enumerate((0, 5, 9)): ref[b, :, s:s + 3] = k[b]        # the plain per-row loop
    assert torch.equal(c.k[1], ref) and not c.k[0].any()
    with pytest.raises(ValueError, match='overflow'): c.write(0, torch.zeros(3, 2, 8, 4), torch.zeros(3, 2, 8, 4), c.lengths)
    c.lengths = torch.tensor([3, 8, 12])
    sub = c.take([2, 0])
    assert sub.lengths.tolist() == [12, 3] and torch.equal(sub.k[1][0, :, :12], c.k[1][2, :, :12])
    sub.write(0, torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), sub.lengths); sub.lengths = sub.lengths + 1
    c.put([2, 0], sub)
    assert c.lengths.tolist() == [4, 8, 13] and (c.k[0][2, :, 12] == 1).all() and (c.k[0][0, :, 3] == 1).all()
    assert not c.k[0][1].any()                                           # the row not taken is untouched
    sub = c.take([1], room=2)                                            # capacity: the longest row and 2 more
    assert sub.max_len == 10 and sub.k[0].shape == (1, 2, 10, 4) and torch.equal(sub.k[1][0, :, :8], c.k[1][1, :, :8])
    with pytest.raises(ValueError, match='overflow'): sub.write(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), sub.lengths)


@pytest.mark.numerics
def test_rows_fed_apart_agree_with_the_whole_batch():
    # The rollout engine feeds multi-token rows through `take`/`put` and the others in a second forward: the same
    # computation per row as one padded batch up to fp32 rounding (other batch shapes block the GEMMs differently).
    m = model(); ids = torch.randint(0, 97, (4, 12))
    c1, c2 = KVCache.for_model(m, 4, 32), KVCache.for_model(m, 4, 32)
    with torch.no_grad():
        m(ids[:, :4], cache=c1); m(ids[:, :4], cache=c2)
        lens = torch.tensor([8, 1, 8, 1])
        whole = m(ids[:, 4:], cache=c1, input_lens=lens, logits_at=lens - 1).logits
        sub = c2.take([0, 2]); a = m(ids[[0, 2], 4:], cache=sub, logits_at=torch.tensor([7, 7])).logits; c2.put([0, 2], sub)
        b = m(ids[:, 4:5], cache=c2, input_lens=torch.tensor([0, 1, 0, 1])).logits
    torch.testing.assert_close(a[:, 0], whole[[0, 2], 0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b[[1, 3], 0], whole[[1, 3], 0], atol=1e-5, rtol=1e-4)
    assert c1.lengths.tolist() == c2.lengths.tolist() == [12, 5, 12, 5]
    for l in range(2): torch.testing.assert_close(c1.k[l][:, :, :12] * (torch.arange(12) < c1.lengths[:, None])[:, None, :, None],
                                                  c2.k[l][:, :, :12] * (torch.arange(12) < c2.lengths[:, None])[:, None, :, None],
                                                  atol=1e-5, rtol=1e-4)


def test_bf16_model_keeps_its_exact_values_in_an_fp32_cache():
    m = model().to(torch.bfloat16); ids = torch.randint(0, 97, (2, 7))
    c32, c16 = KVCache.for_model(m, 2, 16), KVCache.for_model(m, 2, 16, torch.bfloat16)
    assert c32.k[0].dtype == torch.float32
    with torch.no_grad(): a = m(ids, cache=c32).logits; b = m(ids, cache=c16).logits
    # layer 0 sees the same inputs on both paths: its keys/values are the bf16 values, exactly
    assert torch.equal(c32.k[0][:, :, :7], c16.k[0][:, :, :7].float()) and torch.equal(c32.v[0][:, :, :7], c16.v[0][:, :, :7].float())
    # attention in fp32 against bf16: same function, bf16 rounding apart
    torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)


def test_logits_at_a_boolean_mask_gives_the_full_logits_at_its_positions():
    m = model(); ids = torch.randint(0, 97, (3, 10)); at = torch.rand(3, 10) > 0.6; at[1] = False; at[2, -1] = True
    with torch.no_grad():
        full, part = m(ids).logits, m(ids, logits_at=at).logits
    assert part.shape == (int(at.sum()), full.shape[-1])
    # toleranced: the head over fewer rows may block its GEMM differently
    torch.testing.assert_close(part, full[at], atol=1e-5, rtol=1e-5)
