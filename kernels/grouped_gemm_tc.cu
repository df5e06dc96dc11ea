// Tensor-core grouped GEMM for MoE experts (sm_80 and newer; built and checked for sm_90 Hopper):
//   out[rows of expert e] = A[rows of e] @ B[e]^T, with A and B block-scaled low-precision operands.
// nvcuda::wmma bf16 16x16x16 fragments with fp32 accumulation. While a tile is loaded, each element's code x block
// scale is dequantised into bf16 in shared memory (exact: see lowp_common.cuh); the fp32 second-level scales (NVFP4
// S_enc: per row of A, per expert of B) multiply the fp32 accumulators in the epilogue, as production kernels do.
//   grouped_gemm_nvfp4_tc: A row-scaled NVFP4 (codes [N, Kp/2], E4M3 scales [N, Kp/16], S_enc [N]);
//                          B per-expert tensor-scaled NVFP4 (codes [E, O, Kp/2], scales [E, O, Kp/16], S_enc [E]).
//   grouped_gemm_mxfp8_tc: A MXFP8 (elements [N, Kp], E8M0 scales [N, Kp/32]); B MXFP8 ([E, O, Kp], [E, O, Kp/32]);
//                          element format per operand: 0 = E4M3, 1 = E5M2. Blocks run along K for both.
// Not used: FP4/FP8 block-scaled tensor-core MMA (tcgen05, sm_100 only) and sm_90 FP8 wgmma (would need promotion of
// its limited-precision accumulators); both are out of scope here.
// Tiling: CTA = 64 rows (one `tiles` entry: expert, first row, end row) x 64 output columns, K step 32, 128 threads
// = 2 x 2 warps of 32 x 32 outputs (2 x 2 fragments). Grid = (ceil(O / 64), T). Kp = K padded to the quantizer's
// block (16 / 32); the padded codes are zero. Code pointers must be 8-byte aligned (the Python dispatch ensures it).
#include <mma.h>
#include "lowp_common.cuh"

#define TC_BM 64
#define TC_BN 64
#define TC_BK 32
#define TC_THREADS 128
#define TC_LDS (TC_BK + 8)   // bf16 per shared row: 40 (a multiple of 8; 80 bytes, so every 16-row step is 32-byte aligned)
#define TC_LDC (TC_BN + 4)   // fp32 per shared row of the output tile: 68 (a multiple of 4; 16 rows = 4352 bytes)

__device__ __forceinline__ void tc_store16(__nv_bfloat16* dst, const u32* w) {   // dst 16-byte aligned
  uint4* d = reinterpret_cast<uint4*>(dst);
  d[0] = make_uint4(w[0], w[1], w[2], w[3]);
  d[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

template <int MX>
__device__ __forceinline__ void tc_gemm_tile(const u8* __restrict__ a_data, const u8* __restrict__ a_scales,
                                             const float* __restrict__ a_senc, const u8* __restrict__ b_data,
                                             const u8* __restrict__ b_scales, const float* __restrict__ b_senc,
                                             const int* __restrict__ tiles, int O, int Kp, int a_elem, int b_elem,
                                             float* __restrict__ out) {
  using namespace nvcuda;
  __shared__ __align__(32) __nv_bfloat16 As[TC_BM * TC_LDS];
  __shared__ __align__(32) __nv_bfloat16 Bs[TC_BN * TC_LDS];
  __shared__ __align__(32) float Cs[TC_BM * TC_LDC];
  const int e = tiles[blockIdx.y * 3], r0 = tiles[blockIdx.y * 3 + 1], r1 = tiles[blockIdx.y * 3 + 2];
  const int n0 = blockIdx.x * TC_BN, t = threadIdx.x, warp = t / 32;
  const int wm = warp / 2, wn = warp % 2;
  const int lr = t / 2, lk = (t % 2) * 16;                  // loader: tile row lr, 16 elements from lk (both operands)
  const bool va = r0 + lr < r1, vb = n0 + lr < O;
  const long long ra = (long long)r0 + lr, rb = (long long)e * O + n0 + lr;

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++) wmma::fill_fragment(acc[i][j], 0.0f);

  for (int k0 = 0; k0 < Kp; k0 += TC_BK) {
    u32 wa[8], wb[8];
    if (MX) {
      mx_tile_load16(a_data, a_scales, ra, k0 + lk, Kp, a_elem, va, wa);
      mx_tile_load16(b_data, b_scales, rb, k0 + lk, Kp, b_elem, vb, wb);
    } else {
      nv_tile_load16(a_data, a_scales, ra, k0 + lk, Kp, va, wa);
      nv_tile_load16(b_data, b_scales, rb, k0 + lk, Kp, vb, wb);
    }
    tc_store16(As + lr * TC_LDS + lk, wa);
    tc_store16(Bs + lr * TC_LDS + lk, wb);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TC_BK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];  // B^T tile: (k, n) at Bs[n][k]
#pragma unroll
      for (int i = 0; i < 2; i++) wmma::load_matrix_sync(fa[i], As + (wm * 32 + i * 16) * TC_LDS + kk, TC_LDS);
#pragma unroll
      for (int j = 0; j < 2; j++) wmma::load_matrix_sync(fb[j], Bs + (wn * 32 + j * 16) * TC_LDS + kk, TC_LDS);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
    }
    __syncthreads();                                         // before the next step overwrites As / Bs
  }
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 2; j++)
      wmma::store_matrix_sync(Cs + (wm * 32 + i * 16) * TC_LDC + wn * 32 + j * 16, acc[i][j], TC_LDC, wmma::mem_row_major);
  __syncthreads();
  for (int idx = t; idx < TC_BM * TC_BN; idx += TC_THREADS) {
    int r = idx / TC_BN, c = idx % TC_BN, gr = r0 + r, gc = n0 + c;
    if (gr >= r1 || gc >= O) continue;
    float v = Cs[r * TC_LDC + c];
    out[(long long)gr * O + gc] = MX ? v : nv_epilogue(v, a_senc[gr], b_senc[e]);
  }
}

extern "C" __global__ void __launch_bounds__(TC_THREADS) grouped_gemm_nvfp4_tc(
    const u8* __restrict__ a_codes, const u8* __restrict__ a_scales, const float* __restrict__ a_senc,
    const u8* __restrict__ b_codes, const u8* __restrict__ b_scales, const float* __restrict__ b_senc,
    const int* __restrict__ tiles, int O, int Kp, float* __restrict__ out) {
  tc_gemm_tile<0>(a_codes, a_scales, a_senc, b_codes, b_scales, b_senc, tiles, O, Kp, 0, 0, out);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS) grouped_gemm_mxfp8_tc(
    const u8* __restrict__ a_data, const u8* __restrict__ a_scales, int a_elem,
    const u8* __restrict__ b_data, const u8* __restrict__ b_scales, int b_elem,
    const int* __restrict__ tiles, int O, int Kp, float* __restrict__ out) {
  tc_gemm_tile<1>(a_data, a_scales, 0, b_data, b_scales, 0, tiles, O, Kp, a_elem, b_elem, out);
}
