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
    got = K.nvfp4_grouped_gemm(x.cuda(), w.cuda(), counts).cpu().double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4)
