"""composer2.quant against an independent numpy + ml_dtypes reference (bit for bit), plus SR and Hadamard properties."""
import math

import ml_dtypes as mld
import numpy as np
import pytest
import torch

from composer2 import quant as Q

F4, E4, E5, E8 = mld.float4_e2m1fn, mld.float8_e4m3fn, mld.float8_e5m2, mld.float8_e8m0fnu
f32 = np.float32
FMAX = np.finfo(np.float32).max


# ---------------------------------------------------------------- independent reference (numpy + ml_dtypes only)
def ref_nvfp4(x, scale='tensor', block2d=False):
    "Returns (packed codes, scale bits, s_enc, dequantised) following the recipe's §NVFP4 with ml_dtypes casts."
    x = np.asarray(x, dtype=f32)
    shape, K = x.shape, x.shape[-1]
    Kp = -(-K // 16) * 16
    xp = np.zeros(shape[:-1] + (Kp,), f32); xp[..., :K] = x
    rows = xp.reshape(-1, Kp); R, nb = rows.shape[0], Kp // 16
    a = np.abs(rows)
    with np.errstate(all='ignore'):
        A = np.max(a, axis=1, keepdims=True) if scale == 'row' else np.full((R, 1), np.max(a), f32)
        S = np.where(A == 0, f32(1), f32(2688) / A).astype(f32)
        S = np.minimum(S, FMAX)
        S = np.where(np.isfinite(A), S, f32(np.nan)).astype(f32)
        dec = (f32(1) / S).astype(f32)
        blk = a.reshape(R, nb, 16).max(-1)
        if block2d:
            k2 = shape[-2]; mats = R // k2
            blk = blk.reshape(mats, k2, nb).copy()
            for m in range(mats):
                for t in range(0, k2, 16):
                    blk[m, t:t + 16] = blk[m, t:t + 16].max(0, keepdims=True)
            blk = blk.reshape(R, nb)
        s = np.minimum(blk * S / f32(6), f32(448)).astype(f32).astype(E4)
        sf = s.astype(f32)
        enc = np.minimum(f32(1) / (sf * dec), FMAX).astype(f32)
        v = np.clip(rows.reshape(R, nb, 16) * enc[..., None], f32(-6), f32(6)).astype(f32)
        codes = v.astype(F4).view(np.uint8).reshape(R, Kp) & 0xF
        codes[~np.isfinite(S[:, 0])] = 0
        packed = np.zeros((R, Kp // 2), np.uint8)
        for i in range(Kp // 2):                                   # element 2i -> low nibble, 2i+1 -> high nibble
            packed[:, i] = codes[:, 2 * i] | (codes[:, 2 * i + 1] << 4)
        vals = codes.view(F4).astype(f32).reshape(R, nb, 16)
        deq = ((vals * sf[..., None]).astype(f32) * dec[..., None]).astype(f32).reshape(R, Kp)[:, :K].reshape(shape)
    s_enc = S[:, 0].reshape(shape[:-1]) if scale == 'row' else S[0, 0]
    return packed.reshape(shape[:-1] + (Kp // 2,)), s.view(np.uint8).reshape(shape[:-1] + (nb,)), s_enc, deq


MX = {'e4m3': (E4, 8, 448.0), 'e5m2': (E5, 15, 57344.0)}


def ref_mxfp8(x, elem='e4m3', rule='floor'):
    "Returns (element bits, E8M0 bits, dequantised) following OCP MX v1.0 with ml_dtypes casts."
    dt, emax, maxv = MX[elem]
    x = np.asarray(x, dtype=f32); shape, K = x.shape, x.shape[-1]
    Kp = -(-K // 32) * 32
    xp = np.zeros(shape[:-1] + (Kp,), f32); xp[..., :K] = x
    b = xp.reshape(-1, Kp // 32, 32)
    with np.errstate(all='ignore'):
        amax = np.max(np.abs(b), axis=-1)
        bad = ~np.isfinite(amax)
        a64 = np.where(bad | (amax == 0), 1.0, amax).astype(np.float64)
        if rule == 'floor':
            e = np.floor(np.log2(a64)) - emax
        else:
            d = (a64.astype(f32) / f32(maxv)).astype(f32).astype(np.float64)
            e = np.where(d == 0, -127, np.ceil(np.log2(np.where(d == 0, 1.0, d))))
        e = np.where(amax == 0, -127, e)
        e = np.clip(e, -127, 127).astype(np.int64)
        bits = np.where(bad, 255, e + 127).astype(np.uint8)
        X = np.where(bad, f32(1), bits.view(E8).astype(f32)).astype(f32)
        P = np.clip(b / X[..., None], f32(-maxv), f32(maxv)).astype(f32).astype(dt)
        P = np.where(bad[..., None], np.zeros((), dt), P)
        deq = (P.astype(f32) * bits.view(E8).astype(f32)[..., None]).astype(f32)
    deq = deq.reshape(-1, Kp)[:, :K].reshape(shape)
    return P.view(np.uint8).reshape(shape[:-1] + (Kp,)), bits.reshape(shape[:-1] + (Kp // 32,)), deq


def same_bits(a, b):
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32)) or \
        (a.shape == b.shape and np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)]))


def check_nvfp4(x, scale='tensor', block2d=False):
    q = Q.quantize_nvfp4(torch.from_numpy(np.asarray(x, f32)), scale=scale, block2d=block2d)
    pk, sb, se, deq = ref_nvfp4(x, scale, block2d)
    assert np.array_equal(q.codes.numpy(), pk), 'codes differ'
    assert np.array_equal(q.scales.numpy(), sb), 'block scales differ'
    assert same_bits(q.s_enc.numpy(), se), 'second-level scale differs'
    assert same_bits(Q.dequantize_nvfp4(q).numpy(), deq), 'dequantised values differ'


def check_mxfp8(x, elem, rule):
    q = Q.quantize_mxfp8(torch.from_numpy(np.asarray(x, f32)), elem=elem, rule=rule)
    pb, sb, deq = ref_mxfp8(x, elem, rule)
    assert np.array_equal(q.data.view(torch.uint8).numpy(), pb), 'elements differ'
    assert np.array_equal(q.scales.numpy(), sb), 'E8M0 scales differ'
    assert same_bits(Q.dequantize_mxfp8(q).numpy(), deq), 'dequantised values differ'


# ---------------------------------------------------------------- adversarial inputs
E2M1_BOUNDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
RNG = np.random.default_rng(0)


def nvfp4_boundary_tensor():
    "Blocks whose scaled values sit at, and 1e-3 either side of, every E2M1 boundary (S_enc = 1 and s_blk = 1 exactly)."
    vals = []
    for b in E2M1_BOUNDS + [0.5, 1, 1.5, 2, 3, 4, 6]:
        vals += [b, b + 1e-3, b - 1e-3, -b, -b - 1e-3, -b + 1e-3]
    vals += [0.0, -0.0, 1e-4, -1e-4, 5.999, 6.0]
    while len(vals) % 15: vals.append(0.0)
    blocks = [[6.0] + vals[i:i + 15] for i in range(0, len(vals), 15)]      # every block amax 6 -> s_blk = 1
    blocks.append([2688.0] + [0.0] * 15)                                     # tensor amax 2688 -> S_enc = 1
    return np.array(blocks, f32)


def adversarial(kind, shape, rng=RNG):
    x = rng.standard_normal(shape).astype(f32)
    if kind == 'random': return x
    if kind == 'zeros_block': x[..., :16] = 0; x[0] = 0; return x
    if kind == 'all_zero': return np.zeros(shape, f32)
    if kind == 'pow2_amax': x = np.clip(x, -0.99, 0.99); x[..., 3 % shape[-1]] = 4.0; x[..., 20 % shape[-1]] = -0.25; return x
    if kind == 'huge': return (x * f32(1e37)).astype(f32)
    if kind == 'near_max': x[..., 0] = FMAX; return x
    if kind == 'tiny': return (x * f32(1e-40)).astype(f32)        # fp32 subnormals
    if kind == 'mixed_scale':                                      # blocks spanning 40 orders of magnitude
        return (x * (10.0 ** rng.integers(-30, 10, shape)).astype(f32)).astype(f32)
    if kind == 'heavy_tail': return (x * np.exp(rng.standard_normal(shape) * 3)).astype(f32)
    raise KeyError(kind)


KINDS = ['random', 'zeros_block', 'all_zero', 'pow2_amax', 'huge', 'near_max', 'tiny', 'mixed_scale', 'heavy_tail']


# ---------------------------------------------------------------- NVFP4
def test_e2m1_boundaries_bit_exact():
    x = nvfp4_boundary_tensor()
    q = Q.quantize_nvfp4(torch.from_numpy(x))
    assert q.s_enc.item() == 1.0 and (q.scales.view(torch.float8_e4m3fn).float()[:-1] == 1.0).all()
    for scale in ('tensor', 'row'):
        check_nvfp4(x, scale)
    # the recipe's tie list, via the public quantizer
    d = Q.dequantize_nvfp4(q).numpy()
    flat = dict(zip(x[:-1, 1:].ravel().tolist(), d[:-1, 1:].ravel().tolist()))
    for t, want in {0.25: 0, 0.75: 1, 1.25: 1, 1.75: 2, 2.5: 2, 3.5: 4, 5.0: 4}.items():
        assert flat[t] == want and flat[-t] == -want


@pytest.mark.parametrize('scale', ['tensor', 'row'])
@pytest.mark.parametrize('kind', KINDS)
def test_nvfp4_bit_exact(kind, scale):
    for shape in [(8, 64), (5, 40), (3, 1), (2, 3, 17)]:
        check_nvfp4(adversarial(kind, shape), scale)


@pytest.mark.parametrize('kind', KINDS)
def test_nvfp4_2d_blocks_bit_exact(kind):
    for shape in [(32, 48), (20, 40), (3, 17, 33)]:
        check_nvfp4(adversarial(kind, shape), 'tensor', block2d=True)


def test_nvfp4_random_scales_around_boundaries():
    "TE-style: boundary values under random per-block and per-row magnitudes."
    base = nvfp4_boundary_tensor()[:-1]
    for i in range(10):
        x = base * (2.0 ** RNG.integers(-20, 20, (base.shape[0], 1))) * RNG.uniform(0.5, 2, (base.shape[0], 1))
        x = x.astype(f32)
        check_nvfp4(x, 'tensor'); check_nvfp4(x, 'row')


def test_nvfp4_packing_low_nibble_first():
    x = torch.zeros(16); x[0], x[1], x[2], x[3] = 6.0, 0.5, -1.0, 3.0   # codes 7, 1, 10, 5
    q = Q.quantize_nvfp4(x)
    assert q.codes[0].item() == (1 << 4) | 7 and q.codes[1].item() == (5 << 4) | 10
    assert torch.equal(Q.unpack_e2m1(q.codes)[:4], torch.tensor([7, 1, 10, 5], dtype=torch.uint8))


def test_nvfp4_padding_and_shapes():
    x = torch.randn(2, 3, 17)
    q = Q.quantize_nvfp4(x, scale='row')
    assert q.codes.shape == (2, 3, 16) and q.scales.shape == (2, 3, 2) and q.s_enc.shape == (2, 3)
    full = torch.nn.functional.pad(x, (0, 15))
    assert torch.equal(Q.fake_quant_nvfp4(x, 'row'), Q.fake_quant_nvfp4(full, 'row')[..., :17])


def test_nvfp4_zero_and_nonfinite():
    z = Q.quantize_nvfp4(torch.zeros(2, 32))
    assert z.s_enc.item() == 1.0 and (z.codes == 0).all() and (z.scales == 0).all()
    assert (Q.dequantize_nvfp4(z) == 0).all() and not Q.dequantize_nvfp4(z).isnan().any()
    x = torch.randn(3, 32); x[1, 5] = float('inf')
    q = Q.quantize_nvfp4(x, 'row'); d = Q.dequantize_nvfp4(q)
    assert d[1].isnan().all() and torch.isfinite(d[[0, 2]]).all()
    assert (q.scales[1] == 0x7F).all() and (q.codes[1] == 0).all() and q.s_enc[1].isnan()
    assert Q.dequantize_nvfp4(Q.quantize_nvfp4(x, 'tensor')).isnan().all()
    x[1, 5] = float('nan'); check_nvfp4(x.numpy(), 'row'); check_nvfp4(x.numpy(), 'tensor')


def test_nvfp4_2d_transpose_invariance():
    w = torch.randn(48, 80)
    assert torch.equal(Q.fake_quant_nvfp4(w, block2d=True).t(), Q.fake_quant_nvfp4(w.t().contiguous(), block2d=True))


def test_bad_input_errors():
    with pytest.raises(ValueError, match='scale'): Q.quantize_nvfp4(torch.randn(4, 16), scale='col')
    with pytest.raises(ValueError, match='block2d'): Q.quantize_nvfp4(torch.randn(4, 16), scale='row', block2d=True)
    with pytest.raises(ValueError, match='floating'): Q.quantize_nvfp4(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match='non-empty'): Q.quantize_mxfp8(torch.zeros(0, 32))
    with pytest.raises(ValueError, match='elem'): Q.quantize_mxfp8(torch.randn(4, 32), elem='e3m4')
    with pytest.raises(ValueError, match='rule'): Q.quantize_mxfp8(torch.randn(4, 32), rule='ceil')
    with pytest.raises(ValueError, match='shape'): Q.quantize_mxfp8(torch.randn(4, 32), sr=True, u=torch.rand(4, 31))


# ---------------------------------------------------------------- MXFP8
def fp8_midpoints(dt, n):
    g = np.arange(n, dtype=np.uint8).view(dt).astype(np.float64)
    mids = (g[:-1] + g[1:]) / 2
    return np.concatenate([g, mids, mids * (1 + 1e-3), mids * (1 - 1e-3)])


@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
@pytest.mark.parametrize('rule', ['floor', 'rceil'])
def test_mxfp8_boundaries_bit_exact(elem, rule):
    dt, emax, maxv = MX[elem]
    v = fp8_midpoints(dt, 127 if elem == 'e4m3' else 124)
    v = v[v <= maxv]
    v = np.concatenate([v, -v])
    pad = (-len(v)) % 31
    v = np.concatenate([v, np.zeros(pad)]).reshape(-1, 31)
    top = 2.0 ** emax                                                   # floor rule: amax 2^emax -> X = 1
    x = np.concatenate([np.full((len(v), 1), top), v], 1).astype(f32)
    check_mxfp8(x, elem, rule)
    if rule == 'floor':
        q = Q.quantize_mxfp8(torch.from_numpy(x), elem, rule)
        assert (q.scales == 127).all()
    for k in (-30, -3, 5, 40):                                          # same boundaries under other scales
        check_mxfp8((x * f32(2.0 ** k)).astype(f32), elem, rule)


@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
@pytest.mark.parametrize('rule', ['floor', 'rceil'])
@pytest.mark.parametrize('kind', KINDS)
def test_mxfp8_bit_exact(kind, elem, rule):
    for shape in [(8, 64), (5, 70), (3, 1), (2, 3, 33)]:
        check_mxfp8(adversarial(kind, shape), elem, rule)


def test_mxfp8_saturation_and_rules():
    x = torch.zeros(2, 32); x[0, 0] = 1.99; x[1, 0] = 511.0
    f = Q.quantize_mxfp8(x, 'e4m3', 'floor'); r = Q.quantize_mxfp8(x, 'e4m3', 'rceil')
    assert f.data.float()[0, 0].item() == 448.0 and f.data.float()[1, 0].item() == 448.0      # floor saturates
    assert r.data.float().abs().max() <= 448 and Q.dequantize_mxfp8(r)[0, 0].item() == 2.0
    check_mxfp8(x.numpy(), 'e4m3', 'floor'); check_mxfp8(x.numpy(), 'e4m3', 'rceil')


def test_mxfp8_zero_nonfinite_and_clamp():
    z = Q.quantize_mxfp8(torch.zeros(1, 64))
    assert (z.scales == 0).all() and (z.data.view(torch.uint8) == 0).all() and (Q.dequantize_mxfp8(z) == 0).all()
    x = torch.randn(2, 64); x[0, 40] = float('nan'); x[1, 3] = -float('inf')
    q = Q.quantize_mxfp8(x); d = Q.dequantize_mxfp8(q)
    assert q.scales.tolist() == [[q.scales[0, 0].item(), 255], [255, q.scales[1, 1].item()]]
    assert d[0, 32:].isnan().all() and torch.isfinite(d[0, :32]).all() and d[1, :32].isnan().all()
    check_mxfp8(x.numpy(), 'e4m3', 'floor'); check_mxfp8(x.numpy(), 'e5m2', 'rceil')
    t = torch.full((1, 32), 2.0 ** -140)                                # exponent clamps to -127
    assert Q.quantize_mxfp8(t).scales.item() == 0
    h = torch.full((1, 32), 3e38)
    assert Q.quantize_mxfp8(h, 'e4m3', 'floor').scales.item() == 127 + 127 - 8


def test_e8m0_matches_ml_dtypes():
    bits = np.arange(256, dtype=np.uint8)
    assert same_bits(Q.e8m0_to_f32(torch.from_numpy(bits)).numpy(), bits.view(E8).astype(f32))


# ---------------------------------------------------------------- stochastic rounding
@pytest.mark.parametrize('fmt,dt,n', [('e2m1', None, 8), ('e4m3', E4, 127), ('e5m2', E5, 124)])
def test_stochastic_rounding_unbiased(fmt, dt, n):
    g = torch.Generator().manual_seed(1)
    grid = Q._GRIDS[fmt].double().numpy()
    vals = torch.tensor(RNG.uniform(-grid[-1] * 0.9, grid[-1] * 0.9, 64), dtype=torch.float32)
    draws = 4000
    v = vals.repeat(draws, 1)
    r = Q.stochastic_round(v, fmt, generator=g)
    # every draw is one of the two neighbours in the format
    assert np.isin(np.abs(r.numpy()), grid.astype(f32)).all()
    mean, var = r.double().mean(0), r.double().var(0)
    se = (var / draws).sqrt().clamp_min(1e-12)
    z = ((mean - vals.double()) / se).abs()
    assert z.max() < 5, z.max()                                          # 64 tests, |z| < 5 each
    exact = torch.tensor(grid[1:4], dtype=torch.float32)
    assert torch.equal(Q.stochastic_round(exact, fmt, generator=g), exact)   # representable values are kept


def _sr_within_mc_error(fq, x, draws, g):
    "|mean of draws - x| within 5 sigma of the two-point law between the neighbours lo (u->1) and hi (u=0)."
    hi = fq(x, u=torch.zeros_like(x)).double(); lo = fq(x, u=torch.full_like(x, 1 - 2 ** -24)).double()
    m = torch.stack([fq(x, generator=g) for _ in range(draws)]).double().mean(0)
    xd = x.double()
    sigma = ((hi - xd).abs() * (xd - lo).abs() / draws).sqrt()
    return (m - xd).abs() <= 5 * sigma + 1e-6 * xd.abs()


def test_sr_in_quantizers_unbiased_and_reproducible():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    u = torch.rand(4, 64, generator=torch.Generator().manual_seed(3))
    a = Q.quantize_mxfp8(x, sr=True, u=u); b = Q.quantize_mxfp8(x, sr=True, u=u)
    assert not torch.equal(a.data.view(torch.uint8), Q.quantize_mxfp8(x).data.view(torch.uint8))
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
    g = torch.Generator().manual_seed(4)
    # rceil: nothing saturates, so SR is unbiased everywhere (the floor rule clips its block maxima)
    mx = lambda t, **kw: Q.fake_quant_mxfp8(t, rule='rceil', sr=True, **kw)
    assert _sr_within_mc_error(mx, x, 400, g).all()
    nv = lambda t, **kw: Q.fake_quant_nvfp4(t, 'row', sr=True, **kw)
    blkmax = x.abs().view(4, 4, 16).amax(-1, keepdim=True).expand(4, 4, 16).reshape(4, 64)
    inside = x.abs() < 0.9 * blkmax                       # values near a block max may saturate when s_blk rounds down
    assert _sr_within_mc_error(nv, x, 400, g)[inside].all()


# ---------------------------------------------------------------- Hadamard
def test_hadamard_orthogonal():
    H = Q.hadamard(16)
    assert torch.equal(H @ H.t(), 16 * torch.eye(16))
    for seed in range(3):
        M = Q.random_hadamard(seed, dtype=torch.float64)
        assert torch.allclose(M @ M.t(), torch.eye(16, dtype=torch.float64), atol=1e-15, rtol=0)
    assert not torch.equal(Q.random_hadamard(0), Q.random_hadamard(1))
    with pytest.raises(ValueError): Q.hadamard(12)


def test_rht_leaves_wgrad_unchanged_fp64():
    g = torch.Generator().manual_seed(0)
    for n in (16, 48, 37):
        dy = torch.randn(n, 24, dtype=torch.float64, generator=g); x = torch.randn(n, 40, dtype=torch.float64, generator=g)
        tdy, tx = Q.rht(dy, 0), Q.rht(x, 0)
        assert tdy.shape[0] % 16 == 0
        assert torch.allclose(tdy.t() @ tx, dy.t() @ x, atol=1e-12, rtol=0)
        assert not torch.allclose(tdy[:n], dy)


@pytest.mark.parametrize('fmt', ['e2m1', 'e4m3', 'e5m2'])
def test_stochastic_round_arithmetic_equals_table_search(fmt):
    "The fast neighbour arithmetic picks exactly the neighbours of a search through the format's table of values."
    g = torch.Generator().manual_seed(7)
    grid, mx = Q._GRIDS[fmt], Q._SR_FMT[fmt][2]
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    v = torch.cat([torch.randn(20000, generator=g) * mx / 4, torch.randn(2000, generator=g) * 1e-4, mids, mids * (1 + 1e-3),
                   mids * (1 - 1e-3), torch.tensor([0., mx, mx * 2, float('inf'), 1e-45, 1e-40])])
    v = torch.cat([v, -v])
    for u in (torch.rand(v.shape, generator=g), torch.zeros(v.shape), torch.full(v.shape, 1 - 2 ** -24)):
        a, b = Q.stochastic_round(v, fmt, u), Q._stochastic_round_by_table(v, fmt, u)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert Q.stochastic_round(torch.tensor([float('nan')]), fmt).isnan().all()


# ---------------------------------------------------------------- fused numba quantizers == the torch reference, bit for bit
def bits(t): return t.contiguous().view(torch.int32)


@pytest.mark.numerics
@pytest.mark.parametrize('kind', KINDS)
def test_fast_nvfp4_bit_identical_to_reference(kind):
    for shape in [(8, 64), (5, 40), (3, 1), (2, 3, 17), (33, 48)]:
        x = torch.from_numpy(adversarial(kind, shape))
        for scale, b2 in [('row', False), ('tensor', False), ('tensor', True)]:
            r, f = Q.fake_quant_nvfp4(x, scale, b2), Q.fast_fake_quant_nvfp4(x, scale, b2)
            assert f.shape == r.shape and f.stride() == r.stride() and torch.equal(bits(f), bits(r)), (shape, scale, b2)
        w = torch.from_numpy(adversarial(kind, (3, 20, 40)))
        want = torch.stack([Q.fake_quant_nvfp4(m, 'tensor', True) for m in w])
        assert torch.equal(bits(Q.fast_fake_quant_nvfp4(w, 'tensor', True, per_matrix=True)), bits(want))


@pytest.mark.numerics
@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
@pytest.mark.parametrize('rule', ['floor', 'rceil'])
@pytest.mark.parametrize('kind', KINDS)
def test_fast_mxfp8_bit_identical_to_reference(kind, elem, rule):
    for shape in [(8, 64), (5, 40), (3, 1), (2, 3, 17), (7, 96)]:
        x = torch.from_numpy(adversarial(kind, shape))
        for sr in (False, True):
            torch.manual_seed(11); r = Q.fake_quant_mxfp8(x, elem, rule, sr=sr); nr = torch.rand(2)
            torch.manual_seed(11); f = Q.fast_fake_quant_mxfp8(x, elem, rule, sr=sr); nf = torch.rand(2)
            assert f.shape == r.shape and f.stride() == r.stride() and torch.equal(bits(f), bits(r)), (shape, sr)
            assert torch.equal(nr, nf)                               # the same uniforms were drawn from the stream


@pytest.mark.numerics
def test_fast_quantizers_boundaries_and_nonfinite():
    xb = torch.from_numpy(nvfp4_boundary_tensor())
    for scale in ('tensor', 'row'):
        assert torch.equal(bits(Q.fast_fake_quant_nvfp4(xb, scale)), bits(Q.fake_quant_nvfp4(xb, scale)))
    g = torch.Generator().manual_seed(0)
    for v in (float('nan'), float('inf'), -float('inf')):                 # fall back to the reference
        x = torch.randn(4, 64, generator=g); x[1, 5] = v
        for scale in ('tensor', 'row'):
            assert torch.equal(bits(Q.fast_fake_quant_nvfp4(x, scale)), bits(Q.fake_quant_nvfp4(x, scale)))
        u = torch.rand(4, 64, generator=g)
        assert torch.equal(bits(Q.fast_fake_quant_mxfp8(x, 'e4m3', 'rceil', sr=True, u=u)),
                           bits(Q.fake_quant_mxfp8(x, 'e4m3', 'rceil', sr=True, u=u)))
    # every positive e4m3/e5m2 value and the midpoints between neighbours (ties to even) through the MXFP8 path
    for elem, dt in (('e4m3', torch.float8_e4m3fn), ('e5m2', torch.float8_e5m2)):
        grid = torch.arange(1, 127 if elem == 'e4m3' else 124, dtype=torch.uint8).view(dt).float()
        mids = (grid[1:] + grid[:-1]) / 2
        x = torch.cat([grid, mids, -mids, torch.nextafter(mids, torch.zeros(1)), torch.nextafter(mids, torch.full((1,), 1e9))])
        x = torch.nn.functional.pad(x, (0, -x.numel() % 32)).view(-1, 32)
        x[:, 0] = grid.max()                                       # every block's scale is 2^0
        assert torch.equal(bits(Q.fast_fake_quant_mxfp8(x, elem, 'floor')), bits(Q.fake_quant_mxfp8(x, elem, 'floor')))


# ---------------------------------------------------------------- SR uniforms (counter-based)
def _lowbias32(x):                       # an independent plain-int statement of the mixer
    x ^= x >> 16; x = (x * 0x7FEB352D) & 0xFFFFFFFF; x ^= x >> 15; x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)

def _sr_u_ref(seed, i):
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    h = _lowbias32(((i & 0xFFFFFFFF) * 0x9E3779B9 + k0) & 0xFFFFFFFF)
    return (_lowbias32(((h ^ k1) + (i >> 32)) & 0xFFFFFFFF) >> 8) * 2.0 ** -24


def test_sr_uniforms_match_a_plain_int_statement_and_look_uniform():
    seed = 0x2F00_1234_ABCD_0042
    u = Q.sr_uniforms(seed, (40, 64))
    assert u.dtype == torch.float32 and u.shape == (40, 64)
    for i in (0, 1, 2, 63, 64, 2559):
        assert u.view(-1)[i].item() == _sr_u_ref(seed, i)
    k = Q._numba_kernels()
    if k is not None:                    # the fused kernel's in-place uniforms, also past 2^32 elements
        for i in (0, 77, 2 ** 32 + 7, 3 * 2 ** 32 - 1):
            assert float(Q._sr_u(np.zeros((0, 0), np.float32), 0, 0, i, seed & 0xFFFFFFFF, seed >> 32)) == _sr_u_ref(seed, i)
    big = Q.sr_uniforms(7, (1 << 20,)).double()
    n = big.numel(); se = (1 / 12 / n) ** .5
    assert abs(big.mean().item() - 0.5) < 5 * se and big.min() >= 0 and big.max() < 1
    hist = torch.histc(big, 16, 0, 1) / n                        # each of 16 bins holds 1/16 within 5 standard errors
    assert (hist - 1 / 16).abs().max() < 5 * (1 / 16 * 15 / 16 / n) ** .5
    lag = torch.corrcoef(torch.stack([big[:-1], big[1:]]))[0, 1].item()
    assert abs(lag) < 5 / n ** .5                                # neighbours are uncorrelated
    other = Q.sr_uniforms(8, (1 << 20,)).double()
    assert abs(torch.corrcoef(torch.stack([big, other]))[0, 1].item()) < 5 / n ** .5
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert Q.sr_seed(g1) == Q.sr_seed(g2) and Q.sr_seed(g1) != Q.sr_seed(torch.Generator().manual_seed(6))
