// Grouped GEMM for MoE experts: out[rows of expert e] = A[rows of e] @ B[e]^T, fp32 accumulation.
// Hopper (sm_90) path: CUDA-core tiled SIMT GEMM (64x64 tile, BK 16, 256 threads, 4x4 outputs per thread).
//   grouped_gemm_f32:   A fp32 [N, K], B fp32 [E, O, K].
//   grouped_gemm_nvfp4: A and B given as NVFP4 (packed E2M1 codes + E4M3 block scales + fp32 S_enc; A row scaled,
//                       B tensor scaled per expert), dequantised while loading the tiles (exactly the values
//                       composer2.quant.dequantize_nvfp4 gives), so only 0.56 bytes per element are read.
// FP4 tensor cores (tcgen05 / block-scaled MMA) exist only on Blackwell sm_100; FP8 wgmma on sm_90 is not used here.
// tiles: int32 [T, 3] = (expert, first row, end row) of each 64-row tile; grid = (ceil(O / 64), T).
#include "lowp_common.cuh"

#define BM 64
#define BN 64
#define BK 16

struct F32Src {
  const float* p; int K;
  __device__ __forceinline__ float at(long long row, int k) const { return p[row * K + k]; }
};
struct NVFP4Src {                 // row-major NVFP4 matrix: codes [rows, Kp/2], scales [rows, Kp/16], S per row or one
  const u8* codes; const u8* scales; const float* senc; int row_scale; int K;
  __device__ __forceinline__ float at(long long row, int k) const {
    int Kp = (K + 15) / 16 * 16;
    u32 byte = codes[row * (Kp / 2) + k / 2];
    return nv_dequant((k & 1) ? byte >> 4 : byte & 15u, scales[row * (Kp / 16) + k / 16], senc[row_scale ? row : 0]);
  }
};

template <class SA, class SB>
__device__ void gemm_tile(SA A, SB B, const int* __restrict__ tiles, int O, int K, float* __restrict__ out) {
  __shared__ float As[BK][BM + 4];
  __shared__ float Bs[BK][BN + 4];
  int e = tiles[blockIdx.y * 3], r0 = tiles[blockIdx.y * 3 + 1], r1 = tiles[blockIdx.y * 3 + 2];
  int n0 = blockIdx.x * BN, t = threadIdx.x, ty = t / 16, tx = t % 16;
  int lr = t / 4, lk = (t % 4) * 4;                          // loader: 64 rows x 16 k, 4 consecutive k per thread
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += BK) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
      int k = k0 + lk + j, ra = r0 + lr, nb = n0 + lr;
      As[lk + j][lr] = (ra < r1 && k < K) ? A.at(ra, k) : 0.0f;
      Bs[lk + j][lr] = (nb < O && k < K) ? B.at((long long)e * O + nb, k) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk++) {
      float a[4], b[4];
#pragma unroll
      for (int i = 0; i < 4; i++) { a[i] = As[kk][ty * 4 + i]; b[i] = Bs[kk][tx * 4 + i]; }
#pragma unroll
      for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; i++) {
    int r = r0 + ty * 4 + i;
    if (r >= r1) continue;
#pragma unroll
    for (int j = 0; j < 4; j++) { int c = n0 + tx * 4 + j; if (c < O) out[(long long)r * O + c] = acc[i][j]; }
  }
}

extern "C" __global__ void __launch_bounds__(256) grouped_gemm_f32(const float* __restrict__ a, const float* __restrict__ b,
                                                                   const int* __restrict__ tiles, int O, int K, float* out) {
  F32Src A{a, K}, B{b, K};
  gemm_tile(A, B, tiles, O, K, out);
}

extern "C" __global__ void __launch_bounds__(256) grouped_gemm_nvfp4(
    const u8* __restrict__ a_codes, const u8* __restrict__ a_scales, const float* __restrict__ a_senc,
    const u8* __restrict__ b_codes, const u8* __restrict__ b_scales, const float* __restrict__ b_senc,
    const int* __restrict__ tiles, int O, int K, float* out) {
  NVFP4Src A{a_codes, a_scales, a_senc, 1, K};
  // B is tensor scaled per expert: its S_enc index is the expert, i.e. row / O.
  struct PerExpert { NVFP4Src s; int O;
    __device__ __forceinline__ float at(long long row, int k) const {
      int Kp = (s.K + 15) / 16 * 16;
      u32 byte = s.codes[row * (Kp / 2) + k / 2];
      return nv_dequant((k & 1) ? byte >> 4 : byte & 15u, s.scales[row * (Kp / 16) + k / 16], s.senc[row / O]);
    } } B{{b_codes, b_scales, b_senc, 0, K}, O};
  gemm_tile(A, B, tiles, O, K, out);
}
