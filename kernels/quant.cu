// Fused NVFP4 / MXFP8 quantize and dequantize kernels (sm_90 and newer; plain CUDA cores, no tensor-core or
// Blackwell-only instruction). Loaded by composer2.kernels through cupy.RawModule; the header below is inlined.
// Layouts (all row-major, contiguous): x [R, K] fp32; Kp = K rounded up to the block; padding columns read as 0.
//   NVFP4: codes u8 [R, Kp/2] (element 2i in the low nibble), scales u8 (E4M3 bits) [R, Kp/16], s_enc fp32.
//   MXFP8: data u8 (E4M3/E5M2 bits) [R, Kp], scales u8 (E8M0 bits) [R, Kp/32].
#include "lowp_common.cuh"

__device__ __forceinline__ u32 warp_max_u32(u32 v) {
  for (int o = 16; o; o >>= 1) { u32 w = __shfl_xor_sync(0xffffffffu, v, o); v = w > v ? w : v; }
  return v;
}

// |x| max over n elements as fp32 bits (NaN > inf > finite), atomically max-ed into *out (zero it first).
extern "C" __global__ void absmax_all(const float* __restrict__ x, long long n, u32* out) {
  u32 m = 0;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    u32 a = absbits(x[i]); m = a > m ? a : m;
  }
  m = warp_max_u32(m);
  if ((threadIdx.x & 31) == 0) atomicMax(out, m);
}

// Per-row |x| max (one CTA per row, blockDim a multiple of 32, <= 1024).
extern "C" __global__ void absmax_rows(const float* __restrict__ x, int K, u32* out) {
  __shared__ u32 part[32];
  const float* row = x + (long long)blockIdx.x * K;
  u32 m = 0;
  for (int i = threadIdx.x; i < K; i += blockDim.x) { u32 a = absbits(row[i]); m = a > m ? a : m; }
  m = warp_max_u32(m);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0;
    m = warp_max_u32(m);
    if (threadIdx.x == 0) out[blockIdx.x] = m;
  }
}

// 16x16 tile |x| max for block2d weights: x is [mats, R2, K]; out [mats, ceil(R2/16), nb] (thread per tile).
extern "C" __global__ void absmax_tiles(const float* __restrict__ x, int mats, int R2, int K, int nb, u32* out) {
  int tr = (R2 + 15) / 16;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)mats * tr * nb) return;
  int b = (int)(t % nb); long long rest = t / nb; int ti = (int)(rest % tr); int mat = (int)(rest / tr);
  u32 m = 0;
  for (int r = ti * 16; r < ti * 16 + 16 && r < R2; r++) {
    const float* row = x + ((long long)mat * R2 + r) * K;
    for (int c = b * 16; c < b * 16 + 16 && c < K; c++) { u32 a = absbits(row[c]); m = a > m ? a : m; }
  }
  out[t] = m;
}

// S_enc from group amax bits (n groups).
extern "C" __global__ void nvfp4_senc(const u32* __restrict__ amax, int n, float* senc) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) senc[i] = nv_s_enc(amax[i]);
}

// NVFP4 quantize: one thread per 16-element block. senc has one entry per row (row_scale=1) or one in total.
// tiles (nullable): 16x16 tile amax bits [mats, ceil(R2/16), nb] for block2d, R2 = rows per matrix.
// u (nullable): uniform [0,1) fp32 [R, Kp] for stochastic rounding.
extern "C" __global__ void nvfp4_quantize(const float* __restrict__ x, int R, int K, int row_scale,
                                          const float* __restrict__ senc, const u32* __restrict__ tiles, int R2,
                                          const float* __restrict__ u, u8* __restrict__ codes, u8* __restrict__ scales) {
  int Kp = (K + 15) / 16 * 16, nb = Kp / 16;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)R * nb) return;
  int r = (int)(t / nb), b = (int)(t % nb);
  const float* row = x + (long long)r * K;
  float v[16];
  u32 m = 0;
#pragma unroll
  for (int j = 0; j < 16; j++) {
    int c = b * 16 + j;
    v[j] = c < K ? row[c] : 0.0f;
    u32 a = absbits(v[j]); m = a > m ? a : m;
  }
  if (tiles) { int tr = (R2 + 15) / 16; m = tiles[((long long)(r / R2) * tr + (r % R2) / 16) * nb + b]; }
  float S = senc[row_scale ? r : 0];
  u64 packed; u32 sc;
  nv_quantize_block(v, m, S, u ? u + (long long)r * Kp + b * 16 : 0, &packed, &sc);
  *(u64*)(codes + (long long)r * (Kp / 2) + b * 8) = packed;
  scales[(long long)r * nb + b] = (u8)sc;
}

// NVFP4 dequantize to fp32 [R, K]: one thread per element.
extern "C" __global__ void nvfp4_dequantize(const u8* __restrict__ codes, const u8* __restrict__ scales,
                                            const float* __restrict__ senc, int row_scale, int R, int K,
                                            float* __restrict__ out) {
  int Kp = (K + 15) / 16 * 16;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)R * K) return;
  int r = (int)(t / K), c = (int)(t % K);
  u32 byte = codes[(long long)r * (Kp / 2) + c / 2];
  u32 code = (c & 1) ? byte >> 4 : byte & 15u;
  out[t] = nv_dequant(code, scales[(long long)r * (Kp / 16) + c / 16], senc[row_scale ? r : 0]);
}

// MXFP8 quantize: one warp per 32-element block, one lane per element. elem 0 = E4M3, 1 = E5M2; rule 0 floor, 1 rceil.
extern "C" __global__ void mxfp8_quantize(const float* __restrict__ x, int R, int K, int elem, int rule,
                                          const float* __restrict__ u, u8* __restrict__ data, u8* __restrict__ scales) {
  int Kp = (K + 31) / 32 * 32, nb = Kp / 32;
  long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  int lane = threadIdx.x & 31;
  if (w >= (long long)R * nb) return;                        // whole warps exit together
  int r = (int)(w / nb), b = (int)(w % nb), c = b * 32 + lane;
  float v = c < K ? x[(long long)r * K + c] : 0.0f;
  u32 m = warp_max_u32(absbits(v));
  u32 sc = mx_scale_code(m, elem, rule);
  float uu = u ? u[(long long)r * Kp + c] : 0.0f;
  data[(long long)r * Kp + c] = (u8)mx_elem_code(v, sc, elem, u != 0, uu);
  if (lane == 0) scales[(long long)r * nb + b] = (u8)sc;
}

// MXFP8 dequantize to fp32 [R, K]: one thread per element.
extern "C" __global__ void mxfp8_dequantize(const u8* __restrict__ data, const u8* __restrict__ scales, int R, int K,
                                            int elem, float* __restrict__ out) {
  int Kp = (K + 31) / 32 * 32;
  long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= (long long)R * K) return;
  int r = (int)(t / K), c = (int)(t % K);
  out[t] = mx_dequant(data[(long long)r * Kp + c], scales[(long long)r * (Kp / 32) + c / 32], elem);
}
