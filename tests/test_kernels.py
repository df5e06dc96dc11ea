"""kernels/*.cu: every source compiles with nvcc for sm_90; the kernels' scalar arithmetic (lowp_common.cuh, built for the
host with g++) is bit-identical to composer2.quant on random and adversarial inputs; on a GPU (skipped otherwise) each
kernel is bit-identical to the reference."""
import shutil, subprocess

import numpy as np
import pytest
import torch

from composer2 import kernels as K
from composer2 import quant as Q
from test_quant import KINDS, adversarial, fp8_midpoints, nvfp4_boundary_tensor, MX

NVCC = shutil.which('nvcc') or ('/usr/local/bin/nvcc' if shutil.which('/usr/local/bin/nvcc') else None)
GXX = shutil.which('g++')
f32 = np.float32


# ---------------------------------------------------------------- sources never rot: nvcc for every target
def _targets():
    for name in K.KERNEL_FILES:
        yield name, 'sm_90'
        if name in K.BLACKWELL_ONLY: yield name, 'sm_100a'


@pytest.mark.skipif(NVCC is None, reason='nvcc not installed')
@pytest.mark.parametrize('name,arch', list(_targets()))
def test_nvcc_compiles(name, arch, tmp_path):
    "The exact text NVRTC gets at run time (header inlined), with the options the loader uses, compiles to a cubin."
    src = tmp_path / name
    src.write_text(K.kernel_source(name))
    out = tmp_path / 'k.cubin'
    r = subprocess.run([NVCC, f'-arch={arch}', '-cubin', '--std=c++14', *K.KERNEL_FILES[name], '-o', str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size > 1000
    if 'warning' in r.stderr: pytest.fail(f'nvcc warnings for {name}:\n{r.stderr[-3000:]}')


def test_every_kernel_source_is_registered():
    on_disk = {p.name for p in K.kernels_dir().glob('*.cu')}
    assert on_disk == set(K.KERNEL_FILES), f'kernels/*.cu not in KERNEL_FILES (so never compiled): {on_disk ^ set(K.KERNEL_FILES)}'


# ---------------------------------------------------------------- host build of the kernels' arithmetic
@pytest.fixture(scope='module')
def emu(tmp_path_factory):
    if GXX is None: pytest.skip('g++ not installed')
    return K.build_host_emulation(str(tmp_path_factory.mktemp('emu')))


def _nv_equal(a: Q.NVFP4Tensor, b: Q.NVFP4Tensor):
    assert torch.equal(a.codes, b.codes), 'codes differ'
    assert torch.equal(a.scales, b.scales), 'block scales differ'
    assert torch.equal(a.s_enc.view(torch.int32), b.s_enc.view(torch.int32)) or \
        (a.s_enc.isnan().all() and b.s_enc.isnan().all()), 'second-level scale differs'


def _same_f32(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()].view(torch.int32), b[~b.isnan()].view(torch.int32))


def _check_emu_nvfp4(lib, x, scale, block2d=False, u=None):
    x = torch.as_tensor(np.asarray(x, f32))
    q = K.emulate_nvfp4(lib, x, scale, block2d, u)
    r = Q.quantize_nvfp4(x, scale=scale, block2d=block2d, sr=u is not None, u=u)
    _nv_equal(q, r)
    assert _same_f32(K.emulate_nvfp4_dequantize(lib, q), Q.dequantize_nvfp4(r)), 'dequantised values differ'


def _check_emu_mxfp8(lib, x, elem, rule, u=None):
    x = torch.as_tensor(np.asarray(x, f32))
    q = K.emulate_mxfp8(lib, x, elem, rule, u)
    r = Q.quantize_mxfp8(x, elem=elem, rule=rule, sr=u is not None, u=u)
    assert torch.equal(q.data.view(torch.uint8), r.data.view(torch.uint8)), 'elements differ'
    assert torch.equal(q.scales, r.scales), 'E8M0 scales differ'
    assert _same_f32(K.emulate_mxfp8_dequantize(lib, q), Q.dequantize_mxfp8(r)), 'dequantised values differ'


@pytest.mark.parametrize('scale', ['tensor', 'row'])
def test_emulation_nvfp4_bit_exact(emu, scale):
    _check_emu_nvfp4(emu, nvfp4_boundary_tensor(), scale)
    rng = np.random.default_rng(1)
    for kind in KINDS:
        for shape in [(8, 64), (5, 40), (3, 1), (2, 3, 17)]:
            _check_emu_nvfp4(emu, adversarial(kind, shape, rng), scale)
    base = nvfp4_boundary_tensor()[:-1]
    for _ in range(5):                                         # boundaries under random per-row magnitudes
        _check_emu_nvfp4(emu, base * (2.0 ** rng.integers(-20, 20, (base.shape[0], 1))) * rng.uniform(0.5, 2, (base.shape[0], 1)), scale)
    x = rng.standard_normal((3, 32)).astype(f32); x[1, 5] = np.inf; x[2, 7] = np.nan
    _check_emu_nvfp4(emu, x, scale)


def test_emulation_nvfp4_2d_blocks(emu):
    rng = np.random.default_rng(2)
    for kind in KINDS:
        for shape in [(32, 48), (20, 40), (3, 17, 33)]:
            _check_emu_nvfp4(emu, adversarial(kind, shape, rng), 'tensor', block2d=True)


@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
@pytest.mark.parametrize('rule', ['floor', 'rceil'])
def test_emulation_mxfp8_bit_exact(emu, elem, rule):
    dt, emax, maxv = MX[elem]
    v = fp8_midpoints(dt, 127 if elem == 'e4m3' else 124); v = v[v <= maxv]; v = np.concatenate([v, -v])
    v = np.concatenate([v, np.zeros((-len(v)) % 31)]).reshape(-1, 31)
    x = np.concatenate([np.full((len(v), 1), 2.0 ** emax), v], 1).astype(f32)
    for k in (0, -30, 5, 40): _check_emu_mxfp8(emu, (x * f32(2.0 ** k)).astype(f32), elem, rule)
    rng = np.random.default_rng(3)
    for kind in KINDS:
        for shape in [(8, 64), (5, 70), (3, 1), (2, 3, 33)]:
            _check_emu_mxfp8(emu, adversarial(kind, shape, rng), elem, rule)
    x = rng.standard_normal((3, 64)).astype(f32); x[1, 5] = np.inf; x[2, 40] = np.nan
    _check_emu_mxfp8(emu, x, elem, rule)


def test_emulation_stochastic_rounding_bit_exact(emu):
    "Given the same uniforms, the kernels' SR picks the same neighbour as the reference (incl. u at the probability)."
    rng = np.random.default_rng(4)
    for kind in ('random', 'heavy_tail', 'zeros_block', 'huge'):
        x = adversarial(kind, (6, 80), rng)
        u16 = torch.rand(6, 80); u32 = torch.rand(6, 96)
        _check_emu_nvfp4(emu, x, 'row', u=u16); _check_emu_nvfp4(emu, x, 'tensor', u=u16)
        for elem in ('e4m3', 'e5m2'):
            for rule in ('floor', 'rceil'): _check_emu_mxfp8(emu, x, elem, rule, u=u32)
    x = nvfp4_boundary_tensor()                                # every SR edge case: exact grid points, u = 0 and u -> 1
    for u in (torch.zeros(x.shape), torch.full(x.shape, 1 - 2 ** -24), torch.full(x.shape, 0.5)):
        _check_emu_nvfp4(emu, x, 'tensor', u=u)


# ---------------------------------------------------------------- the kernels themselves (GPU only)
gpu = pytest.mark.skipif(not K.cuda_available(), reason='needs CUDA and cupy')


def _cases():
    rng = np.random.default_rng(5)
    xs = [nvfp4_boundary_tensor()]
    for kind in KINDS:
        for shape in [(8, 64), (5, 40), (3, 1), (2, 3, 17), (33, 80)]: xs.append(adversarial(kind, shape, rng))
    xs.append(rng.standard_normal((1024, 4096)).astype(f32))
    return [torch.from_numpy(x) for x in xs]


@gpu
@pytest.mark.parametrize('scale', ['tensor', 'row'])
def test_gpu_nvfp4_kernels_bit_exact(scale):
    for x in _cases():
        q, r = K.nvfp4_quantize(x.cuda(), scale), Q.quantize_nvfp4(x, scale)
        _nv_equal(Q.NVFP4Tensor(q.codes.cpu(), q.scales.cpu(), q.s_enc.cpu(), q.shape, scale), r)
        assert _same_f32(K.nvfp4_dequantize(q).cpu(), Q.dequantize_nvfp4(r))
        if scale == 'tensor' and x.dim() >= 2:
            q2, r2 = K.nvfp4_quantize(x.cuda(), 'tensor', block2d=True), Q.quantize_nvfp4(x, 'tensor', block2d=True)
            _nv_equal(Q.NVFP4Tensor(q2.codes.cpu(), q2.scales.cpu(), q2.s_enc.cpu(), q2.shape), r2)
        u = torch.rand(*x.shape[:-1], -(-x.shape[-1] // 16) * 16)
        qs, rs = K.nvfp4_quantize(x.cuda(), scale, sr=True, u=u.cuda()), Q.quantize_nvfp4(x, scale, sr=True, u=u)
        _nv_equal(Q.NVFP4Tensor(qs.codes.cpu(), qs.scales.cpu(), qs.s_enc.cpu(), qs.shape), rs)


@gpu
@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
@pytest.mark.parametrize('rule', ['floor', 'rceil'])
def test_gpu_mxfp8_kernels_bit_exact(elem, rule):
    for x in _cases():
        q, r = K.mxfp8_quantize(x.cuda(), elem, rule), Q.quantize_mxfp8(x, elem, rule)
        assert torch.equal(q.data.view(torch.uint8).cpu(), r.data.view(torch.uint8)) and torch.equal(q.scales.cpu(), r.scales)
        assert _same_f32(K.mxfp8_dequantize(q).cpu(), Q.dequantize_mxfp8(r))
        u = torch.rand(*x.shape[:-1], -(-x.shape[-1] // 32) * 32)
        qs, rs = K.mxfp8_quantize(x.cuda(), elem, rule, sr=True, u=u.cuda()), Q.quantize_mxfp8(x, elem, rule, sr=True, u=u)
        assert torch.equal(qs.data.view(torch.uint8).cpu(), rs.data.view(torch.uint8))


@gpu
def test_gpu_grouped_gemm():
    g = torch.Generator().manual_seed(0)
    x, w, counts = torch.randn(300, 96, generator=g), torch.randn(4, 80, 96, generator=g), [100, 0, 130, 70]
    ref = torch.cat([x[:100].double() @ w[0].double().t(), x[100:230].double() @ w[2].double().t(), x[230:].double() @ w[3].double().t()])
    out = K.grouped_gemm(x.cuda(), w.cuda(), counts).cpu().double()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4)
    # NVFP4 operands: the kernel multiplies exactly the reference's dequantised values (fp32 accumulation order differs)
    want = K.nvfp4_grouped_gemm(x, w, counts).double()           # CPU: reference fake quant + torch matmul
    got = K.nvfp4_grouped_gemm(x.cuda(), w.cuda(), counts, tensor_cores=False).cpu().double()   # the SIMT kernel; the
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)                  # tensor-core ones: test_gpu_*_tc below


# ---------------------------------------------------------------- tensor-core grouped GEMMs (grouped_gemm_tc.cu)
import ml_dtypes as mld

BF16 = mld.bfloat16


def _finite_fp8(dt):
    v = np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)
    return v[np.isfinite(v)]


def test_tc_source_registered_for_sm90():
    "The nvcc compile test above parametrises over KERNEL_FILES, so the tensor-core kernels get an sm_90 cubin."
    assert ('grouped_gemm_tc.cu', 'sm_90') in list(_targets())
    src = K.kernel_source('grouped_gemm_tc.cu')
    assert 'grouped_gemm_nvfp4_tc' in src and 'grouped_gemm_mxfp8_tc' in src and 'wmma::mma_sync' in src


def test_bf16_exact_nvfp4_products_exhaustive():
    "Every E2M1 value x every finite E4M3 scale (16 x 254 products) is exactly representable in bfloat16."
    e2m1 = np.arange(16, dtype=np.uint8).view(mld.float4_e2m1fn).astype(np.float64)
    e4m3 = _finite_fp8(mld.float8_e4m3fn)
    assert len(e4m3) == 254
    p = (e2m1[:, None] * e4m3[None, :]).ravel()
    assert np.array_equal(p.astype(BF16).astype(np.float64), p)
    assert np.array_equal(p.astype(np.float32).astype(np.float64), p)      # and in fp32, where the kernel forms it
    nz = np.abs(p[p != 0])
    assert nz.min() == 2.0 ** -10 and nz.max() == 2688.0


# Lowest E8M0 exponent for which element x 2^e is exact in bf16 for every finite element, per element format.
MX_EXACT_FROM = {'e4m3': -124, 'e5m2': -117}


@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
def test_bf16_exact_mxfp8_products_exhaustive(elem):
    """Every finite E4M3 (254) / E5M2 (248) element x every E8M0 scale 2^e, e in [-127, 127] (all finite codes): the
    bf16 product equals the exact product for e >= -124 / -117 unless it is >= 2^128 (then bf16 and fp32, the
    reference's dtype, are both inf); below that, only tiny elements round, by at most half bf16's subnormal step."""
    dt = {'e4m3': mld.float8_e4m3fn, 'e5m2': mld.float8_e5m2}[elem]
    v = _finite_fp8(dt)
    assert len(v) == (254 if elem == 'e4m3' else 248)
    scales = np.arange(255, dtype=np.uint8).view(mld.float8_e8m0fnu).astype(np.float64)   # independent of composer2
    assert np.array_equal(scales, 2.0 ** np.arange(-127, 128))
    lo = MX_EXACT_FROM[elem]
    with np.errstate(over='ignore'):
        for e, s in zip(range(-127, 128), scales):
            p = v * s
            b = p.astype(BF16).astype(np.float64)
            f = p.astype(np.float32).astype(np.float64)
            big = np.abs(p) >= 2.0 ** 128
            assert np.array_equal(np.isinf(b), big) and np.array_equal(np.isinf(f), big)
            if e >= lo: assert np.array_equal(b[~big], p[~big]), e
            else:
                assert not np.array_equal(b, p), e                             # the bound is tight
                assert np.abs(b - p).max() <= 2.0 ** -134, e
                assert np.array_equal(f, p)                                    # the fp32 reference is still exact
    # the scale exponents the quantizer can produce: floor and rceil on the largest and smallest fp32 blocks
    exps = set()
    for rule in ('floor', 'rceil'):
        for a in (np.finfo(f32).max, np.finfo(f32).smallest_subnormal, 1.0):
            q = Q.quantize_mxfp8(torch.full((1, 32), float(a)), elem, rule)
            exps.add(int(q.scales[0, 0]) - 127)
    assert min(exps) == -127 and max(exps) == (120 if elem == 'e4m3' else 113)


def _kinds_nvfp4(rng):
    for kind in KINDS:
        for shape in [(8, 64), (5, 40), (3, 1), (33, 80)]: yield adversarial(kind, shape, rng)


def test_emulation_tc_loaders_nvfp4_bit_exact(emu):
    "The kernels' NVFP4 tile loader (host build): bf16 code x block scale, times 1/S_enc in fp32, is the reference bit for bit."
    rng = np.random.default_rng(6)
    xs = list(_kinds_nvfp4(rng)) + [nvfp4_boundary_tensor()]
    x = rng.standard_normal((3, 32)).astype(f32); x[1, 5] = np.inf; x[2, 7] = np.nan; xs.append(x)
    for x in xs:
        x = torch.from_numpy(x)
        for scale in ('row', 'tensor'):
            q = Q.quantize_nvfp4(x, scale)
            b = K.emulate_dequantize_bf16(emu, q)                               # [R, Kp]
            Kd = x.shape[-1]
            assert (b[:, Kd:] == 0).all() or b[:, Kd:].isnan().all(1).eq(b[:, :1].isnan().all(1)).all()
            dec = 1 / (q.s_enc.reshape(-1, 1) if scale == 'row' else q.s_enc.reshape(1, 1))
            assert _same_f32(b[:, :Kd] * dec, Q.dequantize_nvfp4(q).reshape(-1, Kd))


@pytest.mark.parametrize('elem', ['e4m3', 'e5m2'])
def test_emulation_tc_loaders_mxfp8(emu, elem):
    """The kernels' MXFP8 tile loader (host build) gives the reference's dequantised values bit for bit wherever the
    block's E8M0 exponent is >= -124 (E4M3) / -117 (E5M2); below that (denormal-size blocks) within 2^-134."""
    rng = np.random.default_rng(7)
    lo = MX_EXACT_FROM[elem] + 127
    saw_low = False
    for kind in KINDS:
        for shape in [(8, 64), (5, 70), (3, 1), (33, 96)]:
            x = torch.from_numpy(adversarial(kind, shape, rng))
            for rule in ('floor', 'rceil'):
                q = Q.quantize_mxfp8(x, elem, rule)
                b = K.emulate_dequantize_bf16(emu, q)
                Kd = x.shape[-1]; ref = Q.dequantize_mxfp8(q).reshape(-1, Kd)
                sc = q.scales.reshape(-1, q.scales.shape[-1]).repeat_interleave(32, 1)[:, :Kd]
                ok = sc.long() >= lo
                saw_low |= bool((~ok).any())
                assert _same_f32(b[:, :Kd][ok], ref[ok])
                assert ((b[:, :Kd][~ok] - ref[~ok]).abs() <= 2.0 ** -134).all()
    assert saw_low                                                             # 'tiny' inputs reach the inexact scales
    x = torch.randn(3, 64); x[1, 5] = float('inf'); x[2, 40] = float('nan')
    q = Q.quantize_mxfp8(x, elem)
    assert _same_f32(K.emulate_dequantize_bf16(emu, q), Q.dequantize_mxfp8(q))


def _gemm_tol(xd, wd, counts):
    """Allowed |kernel - exact| per output: (K + 4) * 2^-22 * (|A| |B|^T), fp64. The exact value is the fp64 product of
    the reference's dequantised operands. Worst case for the kernel: products of bf16 values are exact in fp32; a
    K-term fp32 sum, even with truncating (not round-to-nearest) accumulation as tensor cores may do, is off by at most
    (K - 1) * 2^-23 * sum|a b|; the NVFP4 epilogue adds 2 roundings and the reference's own dequantise 2 * 2^-24 per
    term: about (K + 2) * 2^-23 in all, half the tolerance. Accumulation order differs from any reference, so no
    tighter, bit-level comparison is possible."""
    K_ = xd.shape[1]
    bound = torch.zeros(xd.shape[0], wd.shape[1], dtype=torch.float64); o = 0
    for e, n in enumerate(counts):
        if n: bound[o:o + n] = xd[o:o + n].double().abs() @ wd[e].double().abs().t()
        o += n
    return (K_ + 4) * 2.0 ** -22 * bound


def _exact(xd, wd, counts):
    out = torch.zeros(xd.shape[0], wd.shape[1], dtype=torch.float64); o = 0
    for e, n in enumerate(counts):
        if n: out[o:o + n] = xd[o:o + n].double() @ wd[e].double().t()
        o += n
    return out


def _nv_weights_f32(wq, K_):
    bc, bs, be = wq
    return torch.stack([Q.dequantize_nvfp4(Q.NVFP4Tensor(bc[e], bs[e], be[e], (bc.shape[1], K_), 'tensor', True)) for e in range(bc.shape[0])])


GEMM_CASES = [  # (counts, O, K): ragged experts, empty experts, O and K off the tile sizes, a K padded to 16 not 32
    ([100, 0, 130, 70], 80, 100),
    ([1, 64, 65, 0], 64, 32),
    ([0, 0, 3], 130, 16),
    ([200], 1, 48),
    ([17, 5], 33, 7),
]


def _operands(counts, O, K_, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K_, generator=g) * torch.exp(torch.randn(sum(counts), 1, generator=g))
    w = torch.randn(len(counts), O, K_, generator=g) / 8
    return x, w


@pytest.mark.parametrize('case', range(len(GEMM_CASES)))
def test_emulation_grouped_gemm_tc(emu, case):
    "The kernels' CTA loop on the host (tiles, loaders, bounds, epilogue) against the exact product, both formats."
    counts, O, K_ = GEMM_CASES[case]
    x, w = _operands(counts, O, K_, case)
    xq, wq = Q.quantize_nvfp4(x, 'row'), K.quantize_experts_nvfp4(w)
    xd, wd = Q.dequantize_nvfp4(xq), _nv_weights_f32(wq, K_)
    got = K.emulate_grouped_gemm_tc(emu, xq, wq, counts).double()
    assert ((got - _exact(xd, wd, counts)).abs() <= _gemm_tol(xd, wd, counts)).all()
    for ex, ew in (('e4m3', 'e4m3'), ('e5m2', 'e4m3')):
        mq, mw = Q.quantize_mxfp8(x, ex), Q.quantize_mxfp8(w, ew)
        xd, wd = Q.dequantize_mxfp8(mq), Q.dequantize_mxfp8(mw)
        got = K.emulate_grouped_gemm_tc(emu, mq, mw, counts).double()
        assert ((got - _exact(xd, wd, counts)).abs() <= _gemm_tol(xd, wd, counts)).all()


# ---- CPU dispatch: the fallback is the reference, and bad inputs fail clearly
def test_cpu_fallback_grouped_gemms():
    counts, O, K_ = GEMM_CASES[0]
    x, w = _operands(counts, O, K_, 0)
    xq, wq = Q.quantize_nvfp4(x, 'row'), K.quantize_experts_nvfp4(w)
    ref = _exact(Q.dequantize_nvfp4(xq), _nv_weights_f32(wq, K_), counts)
    for tc in (None, True, False):                                      # no CUDA: tensor_cores has nothing to choose
        got = K.nvfp4_grouped_gemm_q(xq, wq, counts, tensor_cores=tc)
        assert got.dtype == torch.float32 and got.shape == (x.shape[0], O)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert (got[100:100] == 0).all()
    from composer2.lowp import lowp_grouped_linear, LowpConfig
    assert torch.equal(K.nvfp4_grouped_gemm(x, w, counts), lowp_grouped_linear(x, w, counts, cfg=LowpConfig()))
    mq, mw = Q.quantize_mxfp8(x, 'e4m3', 'rceil'), Q.quantize_mxfp8(w, 'e5m2', 'rceil')
    ref = _exact(Q.dequantize_mxfp8(mq), Q.dequantize_mxfp8(mw), counts)
    got = K.mxfp8_grouped_gemm(x, w, counts, 'e4m3', w_elem='e5m2', rule='rceil')
    assert torch.equal(got, K.mxfp8_grouped_gemm_q(mq, mw, counts))
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
    # empty: no rows, or every expert empty
    assert K.mxfp8_grouped_gemm(x[:0], w, [0, 0, 0, 0]).shape == (0, O)
    assert K.nvfp4_grouped_gemm(x[:0], w, [0, 0, 0, 0]).shape == (0, O)


def test_grouped_gemm_errors():
    counts, O, K_ = GEMM_CASES[0]
    x, w = _operands(counts, O, K_, 0)
    xq, wq = Q.quantize_nvfp4(x, 'row'), K.quantize_experts_nvfp4(w)
    with pytest.raises(ValueError, match='tensor_cores'): K.nvfp4_grouped_gemm_q(xq, wq, counts, tensor_cores='yes')
    with pytest.raises(ValueError, match='tensor_cores'): K.nvfp4_grouped_gemm(x, w, counts, tensor_cores=1.0)
    with pytest.raises(ValueError, match='row-scaled'): K.nvfp4_grouped_gemm_q(Q.quantize_nvfp4(x, 'tensor'), wq, counts)
    with pytest.raises(ValueError, match='NVFP4Tensor'): K.nvfp4_grouped_gemm_q(x, wq, counts)
    with pytest.raises(ValueError, match='codes, scales, s_enc'): K.nvfp4_grouped_gemm_q(xq, wq[:2], counts)
    with pytest.raises(ValueError, match='weight codes'): K.nvfp4_grouped_gemm_q(xq, (wq[0].float(), wq[1], wq[2]), counts)
    with pytest.raises(ValueError, match='weight codes'): K.nvfp4_grouped_gemm_q(xq, (wq[0][..., :-8], wq[1], wq[2]), counts)
    with pytest.raises(ValueError, match='weight s_enc'): K.nvfp4_grouped_gemm_q(xq, (wq[0], wq[1], wq[2].double()), counts)
    with pytest.raises(ValueError, match='counts sum'): K.nvfp4_grouped_gemm_q(xq, wq, [100, 0, 130, 71])
    with pytest.raises(ValueError, match='entries'): K.nvfp4_grouped_gemm_q(xq, wq, [100, 0, 200])
    with pytest.raises(ValueError, match='non-negative'): K.nvfp4_grouped_gemm_q(xq, wq, [100, 0, 130, 70.0])
    with pytest.raises(ValueError, match='features'): K.nvfp4_grouped_gemm(x, w[..., :-1], counts)
    mq, mw = Q.quantize_mxfp8(x), Q.quantize_mxfp8(w)
    with pytest.raises(ValueError, match='MXFP8Tensor'): K.mxfp8_grouped_gemm_q(xq, mw, counts)
    with pytest.raises(ValueError, match='3 dims'): K.mxfp8_grouped_gemm_q(mq, mq, counts)
    with pytest.raises(ValueError, match='features'): K.mxfp8_grouped_gemm_q(mq, Q.quantize_mxfp8(w[..., :-1]), counts)
    bad = Q.MXFP8Tensor(mq.data.view(torch.uint8), mq.scales, mq.shape)
    with pytest.raises(ValueError, match='elem'): K.mxfp8_grouped_gemm_q(bad, mw, counts)
    bad = Q.MXFP8Tensor(mq.data, mq.scales[:, :1], mq.shape)
    with pytest.raises(ValueError, match='xq.scales'): K.mxfp8_grouped_gemm_q(bad, mw, counts)
    with pytest.raises(ValueError, match="'e4m3' or 'e5m2'"): K.mxfp8_grouped_gemm(x, w, counts, 'e3m4')
    with pytest.raises(ValueError, match='tensor_cores'): K.mxfp8_grouped_gemm(x, w, counts, tensor_cores='auto')


# ---- on a GPU (skipped otherwise): each tensor-core kernel against the exact product of the reference's operands
def _nv_cuda(xq, wq):
    return Q.NVFP4Tensor(xq.codes.cuda(), xq.scales.cuda(), xq.s_enc.cuda(), xq.shape, 'row'), tuple(t.cuda() for t in wq)


def _mx_cuda(q):
    return Q.MXFP8Tensor(q.data.cuda(), q.scales.cuda(), q.shape, q.elem, q.rule)


@gpu
@pytest.mark.parametrize('case', range(len(GEMM_CASES)))
def test_gpu_nvfp4_grouped_gemm_tc(case):
    counts, O, K_ = GEMM_CASES[case]
    x, w = _operands(counts, O, K_, case)
    xq, wq = Q.quantize_nvfp4(x, 'row'), K.quantize_experts_nvfp4(w)
    xd, wd = Q.dequantize_nvfp4(xq), _nv_weights_f32(wq, K_)
    exact, tol = _exact(xd, wd, counts), _gemm_tol(xd, wd, counts)
    gx, gw = _nv_cuda(xq, wq)
    for tc in ([True, False] if torch.cuda.get_device_capability() >= (8, 0) else [False]):
        got = K.nvfp4_grouped_gemm_q(gx, gw, counts, tensor_cores=tc).cpu().double()
        err = (got - exact).abs()
        assert (err <= tol).all(), f'tensor_cores={tc}: max err {err.max():.3g}, worst err/tol {(err / tol.clamp(min=1e-300)).max():.3g}'
    if torch.cuda.get_device_capability() >= (8, 0):                  # default = tensor cores, and the fp32 entry point
        assert torch.equal(K.nvfp4_grouped_gemm_q(gx, gw, counts).cpu(), K.nvfp4_grouped_gemm_q(gx, gw, counts, tensor_cores=True).cpu())
        got = K.nvfp4_grouped_gemm(x.cuda(), w.cuda(), counts).cpu().double()
        assert ((got - exact).abs() <= tol).all()


@gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)), reason='needs sm_80+')
@pytest.mark.parametrize('case', range(len(GEMM_CASES)))
@pytest.mark.parametrize('elems', [('e4m3', 'e4m3'), ('e5m2', 'e4m3'), ('e4m3', 'e5m2')])
def test_gpu_mxfp8_grouped_gemm_tc(case, elems):
    counts, O, K_ = GEMM_CASES[case]
    x, w = _operands(counts, O, K_, case)
    mq, mw = Q.quantize_mxfp8(x, elems[0]), Q.quantize_mxfp8(w, elems[1])
    xd, wd = Q.dequantize_mxfp8(mq), Q.dequantize_mxfp8(mw)
    exact, tol = _exact(xd, wd, counts), _gemm_tol(xd, wd, counts)
    got = K.mxfp8_grouped_gemm_q(_mx_cuda(mq), _mx_cuda(mw), counts).cpu().double()
    err = (got - exact).abs()
    assert (err <= tol).all(), f'max err {err.max():.3g}, worst err/tol {(err / tol.clamp(min=1e-300)).max():.3g}'
    ref = K.mxfp8_grouped_gemm_q(_mx_cuda(mq), _mx_cuda(mw), counts, tensor_cores=False).cpu().double()  # GPU reference path
    assert ((ref - exact).abs() <= tol).all()


@gpu
def test_gpu_grouped_gemm_tc_empty_and_unaligned():
    "No rows at all; and operands whose storage is not 16-byte aligned (the dispatch copies them)."
    w = torch.randn(3, 40, 64)
    assert K.nvfp4_grouped_gemm(torch.zeros(0, 64).cuda(), w.cuda(), [0, 0, 0]).shape == (0, 40)
    assert K.mxfp8_grouped_gemm(torch.zeros(0, 64).cuda(), w.cuda(), [0, 0, 0]).shape == (0, 40)
    x = torch.randn(21, 64); counts = [7, 0, 14]
    xq, wq = Q.quantize_nvfp4(x, 'row'), K.quantize_experts_nvfp4(w)
    gx, gw = _nv_cuda(xq, wq)
    big = torch.zeros(21 * 32 + 1, dtype=torch.uint8, device='cuda')
    big[1:].copy_(gx.codes.reshape(-1)); codes = big[1:].view(21, 32)      # data_ptr % 16 == 1
    assert codes.data_ptr() % 16 == 1
    a = K.nvfp4_grouped_gemm_q(Q.NVFP4Tensor(codes, gx.scales, gx.s_enc, gx.shape, 'row'), gw, counts).cpu()
    assert torch.equal(a, K.nvfp4_grouped_gemm_q(gx, gw, counts).cpu())
