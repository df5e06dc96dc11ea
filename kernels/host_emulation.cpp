// Host build of the kernels' arithmetic (lowp_common.cuh) for CPU tests: the same scalar functions the CUDA kernels
// call, driven by plain loops in the kernels' order. Built by tests/test_kernels.py with
//   g++ -O2 -shared -fPIC -ffp-contract=off host_emulation.cpp -o libemu.so
// and compared bit for bit with composer2.quant. It is not used for training.
#include "lowp_common.cuh"

static u32 maxu(u32 a, u32 b) { return a > b ? a : b; }

extern "C" void emu_nvfp4_quantize(const float* x, int R, int K, int row_scale, int R2, const float* u,
                                   u8* codes, u8* scales, float* senc) {
  int Kp = (K + 15) / 16 * 16, nb = Kp / 16;
  u32 tot = 0;
  for (long long i = 0; i < (long long)R * K; i++) tot = maxu(tot, absbits(x[i]));
  for (int r = 0; r < (row_scale ? R : 1); r++) {
    u32 m = 0;
    if (row_scale) for (int c = 0; c < K; c++) m = maxu(m, absbits(x[(long long)r * K + c]));
    senc[r] = nv_s_enc(row_scale ? m : tot);
  }
  for (int r = 0; r < R; r++)
    for (int b = 0; b < nb; b++) {
      float v[16]; u32 m = 0;
      for (int j = 0; j < 16; j++) { int c = b * 16 + j; v[j] = c < K ? x[(long long)r * K + c] : 0.0f; m = maxu(m, absbits(v[j])); }
      if (R2 > 0) {                                          // 16x16 tile of matrix r / R2
        int mat = r / R2, t0 = (r % R2) / 16 * 16; m = 0;
        for (int rr = t0; rr < t0 + 16 && rr < R2; rr++)
          for (int c = b * 16; c < b * 16 + 16 && c < K; c++) m = maxu(m, absbits(x[((long long)mat * R2 + rr) * K + c]));
      }
      u64 packed; u32 sc;
      nv_quantize_block(v, m, senc[row_scale ? r : 0], u ? u + (long long)r * Kp + b * 16 : 0, &packed, &sc);
      for (int i = 0; i < 8; i++) codes[(long long)r * (Kp / 2) + b * 8 + i] = (u8)(packed >> (8 * i));
      scales[(long long)r * nb + b] = (u8)sc;
    }
}

extern "C" void emu_nvfp4_dequantize(const u8* codes, const u8* scales, const float* senc, int row_scale, int R, int K,
                                     float* out) {
  int Kp = (K + 15) / 16 * 16;
  for (int r = 0; r < R; r++)
    for (int c = 0; c < K; c++) {
      u32 byte = codes[(long long)r * (Kp / 2) + c / 2];
      out[(long long)r * K + c] = nv_dequant((c & 1) ? byte >> 4 : byte & 15u, scales[(long long)r * (Kp / 16) + c / 16],
                                             senc[row_scale ? r : 0]);
    }
}

extern "C" void emu_mxfp8_quantize(const float* x, int R, int K, int elem, int rule, const float* u, u8* data, u8* scales) {
  int Kp = (K + 31) / 32 * 32, nb = Kp / 32;
  for (int r = 0; r < R; r++)
    for (int b = 0; b < nb; b++) {
      float v[32]; u32 m = 0;
      for (int j = 0; j < 32; j++) { int c = b * 32 + j; v[j] = c < K ? x[(long long)r * K + c] : 0.0f; m = maxu(m, absbits(v[j])); }
      u32 sc = mx_scale_code(m, elem, rule);
      for (int j = 0; j < 32; j++) {
        long long i = (long long)r * Kp + b * 32 + j;
        data[i] = (u8)mx_elem_code(v[j], sc, elem, u != 0, u ? u[i] : 0.0f);
      }
      scales[(long long)r * nb + b] = (u8)sc;
    }
}

extern "C" void emu_mxfp8_dequantize(const u8* data, const u8* scales, int R, int K, int elem, float* out) {
  int Kp = (K + 31) / 32 * 32;
  for (int r = 0; r < R; r++)
    for (int c = 0; c < K; c++)
      out[(long long)r * K + c] = mx_dequant(data[(long long)r * Kp + c], scales[(long long)r * (Kp / 32) + c / 32], elem);
}

// ---------------------------------------------------------------- tensor-core grouped GEMM (grouped_gemm_tc.cu)
// The tile loaders the kernels call (nv_tile_load16 / mx_tile_load16 -> bf16 bits), over whole K-padded matrices:
// out u16 [R, Kp]. The CPU tests check bf16_to_f32(out) against composer2.quant's dequantised values.
extern "C" void emu_nvfp4_dequantize_bf16(const u8* codes, const u8* scales, int R, int Kp, unsigned short* out) {
  u32 w[8];
  for (int r = 0; r < R; r++)
    for (int k = 0; k < Kp; k += 16) {
      nv_tile_load16(codes, scales, r, k, Kp, true, w);
      for (int j = 0; j < 8; j++) { out[(long long)r * Kp + k + 2 * j] = (unsigned short)(w[j] & 0xffffu); out[(long long)r * Kp + k + 2 * j + 1] = (unsigned short)(w[j] >> 16); }
    }
}
extern "C" void emu_mxfp8_dequantize_bf16(const u8* data, const u8* scales, int R, int Kp, int elem, unsigned short* out) {
  u32 w[8];
  for (int r = 0; r < R; r++)
    for (int k = 0; k < Kp; k += 16) {
      mx_tile_load16(data, scales, r, k, Kp, elem, true, w);
      for (int j = 0; j < 8; j++) { out[(long long)r * Kp + k + 2 * j] = (unsigned short)(w[j] & 0xffffu); out[(long long)r * Kp + k + 2 * j + 1] = (unsigned short)(w[j] >> 16); }
    }
}
// The kernels' CTA loop with the same tiles, loaders, bounds and epilogue; the wmma fragments are replaced by a plain
// fp32 loop (k ascending), so sums agree with the GPU only up to accumulation order. mx = 0: NVFP4, 1: MXFP8.
extern "C" void emu_grouped_gemm_tc(int mx, const u8* a_data, const u8* a_scales, const float* a_senc, int a_elem,
                                    const u8* b_data, const u8* b_scales, const float* b_senc, int b_elem,
                                    const int* tiles, int T, int O, int Kp, float* out) {
  static float As[64][32], Bs[64][32], acc[64][64];
  u32 wa[8], wb[8];
  for (int ty = 0; ty < T; ty++)
    for (int bx = 0; bx < (O + 63) / 64; bx++) {
      int e = tiles[ty * 3], r0 = tiles[ty * 3 + 1], r1 = tiles[ty * 3 + 2], n0 = bx * 64;
      for (int i = 0; i < 64; i++) for (int j = 0; j < 64; j++) acc[i][j] = 0.0f;
      for (int k0 = 0; k0 < Kp; k0 += 32) {
        for (int t = 0; t < 128; t++) {
          int lr = t / 2, lk = (t % 2) * 16;
          bool va = r0 + lr < r1, vb = n0 + lr < O;
          long long ra = (long long)r0 + lr, rb = (long long)e * O + n0 + lr;
          if (mx) { mx_tile_load16(a_data, a_scales, ra, k0 + lk, Kp, a_elem, va, wa); mx_tile_load16(b_data, b_scales, rb, k0 + lk, Kp, b_elem, vb, wb); }
          else { nv_tile_load16(a_data, a_scales, ra, k0 + lk, Kp, va, wa); nv_tile_load16(b_data, b_scales, rb, k0 + lk, Kp, vb, wb); }
          for (int j = 0; j < 8; j++) {
            As[lr][lk + 2 * j] = bf16_to_f32(wa[j] & 0xffffu); As[lr][lk + 2 * j + 1] = bf16_to_f32(wa[j] >> 16);
            Bs[lr][lk + 2 * j] = bf16_to_f32(wb[j] & 0xffffu); Bs[lr][lk + 2 * j + 1] = bf16_to_f32(wb[j] >> 16);
          }
        }
        for (int i = 0; i < 64; i++)
          for (int j = 0; j < 64; j++)
            for (int k = 0; k < 32; k++) acc[i][j] += As[i][k] * Bs[j][k];
      }
      for (int r = 0; r < 64; r++)
        for (int c = 0; c < 64; c++) {
          int gr = r0 + r, gc = n0 + c;
          if (gr >= r1 || gc >= O) continue;
          out[(long long)gr * O + gc] = mx ? acc[r][c] : nv_epilogue(acc[r][c], a_senc[gr], b_senc[e]);
        }
    }
}
