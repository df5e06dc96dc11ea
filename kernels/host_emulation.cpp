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
