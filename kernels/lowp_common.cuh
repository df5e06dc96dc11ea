// Scalar numerics shared by the CUDA kernels and the host emulation used in the CPU tests.
// Every function here is pure fp32/integer arithmetic with the same operation order as composer2.quant (the
// reference), so kernel, host emulation and reference agree bit for bit. No CUDA headers are needed.
#ifndef LOWP_COMMON_CUH
#define LOWP_COMMON_CUH
#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#include <math.h>
#endif
#define HD __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define LOWP_FP32_MAX 3.4028234663852886e38f

HD u32 f2u(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  union { float f; u32 u; } c; c.f = x; return c.u;
#endif
}
HD float u2f(u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  union { float f; u32 u; } c; c.u = u; return c.f;
#endif
}
HD u32 absbits(float x) { return f2u(x) & 0x7fffffffu; }   // uint order == |x| order; NaN bits > inf bits
HD bool bits_finite(u32 a) { return a < 0x7f800000u; }
HD bool is_nan(float x) { return absbits(x) > 0x7f800000u; }
HD float pow2f(int e) {                                      // exact 2^e for e in [-149, 127]
  return e >= -126 ? u2f((u32)(e + 127) << 23) : u2f(1u << (e + 149));
}
HD float clampf(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }   // v is never NaN here

// ---------------------------------------------------------------- small float formats
// One set of helpers for every element format here, described by (mbits, bias, maxv, maxcode):
//   E2M1 (1, 1, 6, 7), E4M3 (3, 7, 448, 0x7e), E5M2 (2, 15, 57344, 0x7b). Codes are magnitudes (no sign bit).
// Round-to-nearest-even of a >= 0 (finite), saturating at the largest finite value maxv.
HD u32 sf_code_rne(float a, int mbits, int bias, float maxv) {
  if (a > maxv) a = maxv;
  if (a < pow2f(-126)) return 0;                            // far below half the smallest subnormal of any format here
  int e = (int)((f2u(a) >> 23) & 0xff) - 127;
  int emin = 1 - bias;
  int qe = (e > emin ? e : emin) - mbits;
  float q = pow2f(qe);
  float r = rintf(a / q) * q;                               // a / q is exact; rintf rounds half to even
  if (r == 0.0f) return 0;
  int re = (int)((f2u(r) >> 23) & 0xff) - 127;
  if (re < emin) return (u32)(r / pow2f(emin - mbits));     // subnormal: the integer mantissa
  return ((u32)(re + bias) << mbits) | ((f2u(r) >> (23 - mbits)) & ((1u << mbits) - 1u));
}
// Value of a magnitude code (no NaN handling; callers never decode NaN codes except through sf_value_e4m3).
HD float sf_value(u32 mag, int mbits, int bias) {
  u32 ex = mag >> mbits, man = mag & ((1u << mbits) - 1u);
  if (ex == 0) return (float)man * pow2f(1 - bias - mbits);
  return (float)((1u << mbits) | man) * pow2f((int)ex - bias - mbits);
}
HD float sf_value_e4m3(u32 code) {                          // float8_e4m3fn byte -> fp32 (0x7f/0xff are NaN)
  u32 mag = code & 0x7fu;
  float v = mag == 0x7fu ? u2f(0x7fc00000u) : sf_value(mag, 3, 7);
  return (code & 0x80u) ? -v : v;
}
// Stochastic rounding of a >= 0 between its two neighbours lo <= a < hi: hi with probability (a - lo) / (hi - lo).
HD u32 sf_code_sr(float a, float u, int mbits, int bias, float maxv, u32 maxcode) {
  if (a > maxv) a = maxv;
  u32 c = sf_code_rne(a, mbits, bias, maxv);
  float r = sf_value(c, mbits, bias);
  u32 clo, chi;
  if (r > a) { clo = c - 1; chi = c; }
  else { clo = c; chi = c < maxcode ? c + 1 : c; }
  float lo = sf_value(clo, mbits, bias), hi = sf_value(chi, mbits, bias);
  float p = (a - lo) / (hi - lo);                           // 0/0 -> NaN at the top: u < NaN is false -> lo
  return u < p ? chi : clo;
}

// ---------------------------------------------------------------- E2M1 = the generic helpers with (1, 1, 6, 7) + sign
HD u32 sign_bit(float v, int pos) { return (f2u(v) >> (31 - pos)) & (1u << pos); }
HD float e2m1_value(u32 code) {
  float v = sf_value(code & 7u, 1, 1);
  return (code & 8u) ? -v : v;
}
HD u32 e2m1_code_rne(float v) { return sf_code_rne(u2f(absbits(v)), 1, 1, 6.0f) | sign_bit(v, 3); }   // v in [-6, 6]
HD u32 e2m1_code_sr(float v, float u) { return sf_code_sr(u2f(absbits(v)), u, 1, 1, 6.0f, 7u) | sign_bit(v, 3); }

// ---------------------------------------------------------------- NVFP4 (recipe §NVFP4)
HD float nv_s_enc(u32 amax_bits) {                          // second-level encode scale from the group amax
  if (!bits_finite(amax_bits)) return u2f(0x7fc00000u);     // non-finite group: poisoned
  float A = u2f(amax_bits);
  if (A == 0.0f) return 1.0f;
  float s = 2688.0f / A;
  return s > LOWP_FP32_MAX ? LOWP_FP32_MAX : s;
}
HD u32 nv_scale_code(u32 blk_amax_bits, float S) {          // e4m3_rne(min(amax_blk * S / 6, 448))
  float s = u2f(blk_amax_bits) * S / 6.0f;
  if (s > 448.0f) s = 448.0f;
  return sf_code_rne(s, 3, 7, 448.0f);
}
HD float nv_encode(u32 scale_code, float S) {               // min(1 / (fp32(s_blk) * (1 / S)), fp32 max)
  float dec = 1.0f / S;
  float e = 1.0f / (sf_value(scale_code, 3, 7) * dec);
  return e > LOWP_FP32_MAX ? LOWP_FP32_MAX : e;
}
HD u32 nv_elem_code(float x, float enc, int sr, float u) {
  float v = clampf(x * enc, -6.0f, 6.0f);
  return sr ? e2m1_code_sr(v, u) : e2m1_code_rne(v);
}
// One 16-element block: values v (padding already 0), block (or tile) amax bits m, group S_enc, optional uniforms u.
HD void nv_quantize_block(const float* v, u32 m, float S, const float* u, u64* packed_out, u32* scale_out) {
  u64 packed = 0;
  u32 sc;
  if (is_nan(S)) sc = 0x7fu;                                 // poisoned group: NaN scale, zero codes
  else {
    sc = nv_scale_code(m, S);
    float enc = nv_encode(sc, S);
    for (int j = 0; j < 16; j++) packed |= (u64)nv_elem_code(v[j], enc, u != 0, u ? u[j] : 0.0f) << (4 * j);
  }
  *packed_out = packed; *scale_out = sc;
}
HD float nv_dequant(u32 code, u32 scale_code, float S) {    // (e2m1_value * fp32(s_blk)) * (1 / S)
  float dec = 1.0f / S;
  return (e2m1_value(code) * sf_value_e4m3(scale_code)) * dec;
}

// ---------------------------------------------------------------- MXFP8 (OCP MX v1.0)
// elem 0: E4M3 (mbits 3, bias 7, emax 8, max 448, maxcode 0x7e); elem 1: E5M2 (2, 15, 15, 57344, 0x7b)
HD int mx_mbits(int elem) { return elem ? 2 : 3; }
HD int mx_bias(int elem) { return elem ? 15 : 7; }
HD int mx_emax(int elem) { return elem ? 15 : 8; }
HD float mx_maxv(int elem) { return elem ? 57344.0f : 448.0f; }
HD u32 mx_maxcode(int elem) { return elem ? 0x7bu : 0x7eu; }

HD int ilog2_floor_bits(u32 b) {                            // floor(log2(x)) of a positive finite fp32 given its bits
  int ex = (int)((b >> 23) & 0xff);
  if (ex) return ex - 127;
  int e = -150;
  while (b) { b >>= 1; e++; }
  return e;
}
HD bool is_pow2_bits(u32 b) {
  if ((b >> 23) & 0xff) return (b & 0x7fffffu) == 0;
  return (b & (b - 1u)) == 0;
}
// E8M0 scale code of a block from its amax bits (255 for a non-finite block). rule 0: floor, 1: rceil.
HD u32 mx_scale_code(u32 amax_bits, int elem, int rule) {
  if (!bits_finite(amax_bits)) return 255u;
  int e;
  if (amax_bits == 0) e = -127;
  else if (rule == 0) e = ilog2_floor_bits(amax_bits) - mx_emax(elem);
  else {
    float d = u2f(amax_bits) / mx_maxv(elem);
    u32 db = f2u(d);
    if (db == 0) e = -127;
    else e = ilog2_floor_bits(db) + (is_pow2_bits(db) ? 0 : 1);
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return (u32)(e + 127);
}
HD float e8m0_value(u32 code) { return code == 255u ? u2f(0x7fc00000u) : pow2f((int)code - 127); }
HD u32 mx_elem_code(float x, u32 scale_code, int elem, int sr, float u) {
  if (scale_code == 255u) return 0;
  float maxv = mx_maxv(elem);
  float v = clampf(x / e8m0_value(scale_code), -maxv, maxv);
  float a = u2f(absbits(v));
  u32 m = sr ? sf_code_sr(a, u, mx_mbits(elem), mx_bias(elem), maxv, mx_maxcode(elem))
             : sf_code_rne(a, mx_mbits(elem), mx_bias(elem), maxv);
  return m | sign_bit(v, 7);
}
HD float mx_dequant(u32 code, u32 scale_code, int elem) {
  float p = sf_value(code & 0x7fu, mx_mbits(elem), mx_bias(elem));
  if (code & 0x80u) p = -p;
  return p * e8m0_value(scale_code);
}

// ---------------------------------------------------------------- bf16 operands of the tensor-core grouped GEMM
// The tensor-core kernels (grouped_gemm_tc.cu) dequantise code x block scale into bf16 while loading a tile and apply
// the fp32 second-level scales (NVFP4 S_enc) to the fp32 accumulators afterwards. code x block scale is exact in bf16:
//   NVFP4: E2M1 (<= 2 significant bits) x E4M3 (<= 4) has <= 6 significant bits (bf16 has 8), |.| in [2^-10, 2688];
//   MXFP8: E4M3/E5M2 (<= 4 / 3 bits) x 2^e is exact in bf16 for e in [-124, 127] / [-117, 127] (bf16 has fp32's
//          exponent range; below those e the smallest elements fall under bf16's subnormal step 2^-133 and are rounded
//          to nearest even; 2^e x element >= 2^128 is inf in fp32 and bf16 alike).
// f32 -> bf16 bits, round to nearest even, NaN -> quiet NaN with its sign. Integer-only, so host == device.
HD u32 f32_to_bf16_rne(float x) {
  u32 u = f2u(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ((u >> 16) & 0x8000u) | 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
HD float bf16_to_f32(u32 b) { return u2f(b << 16); }
// One element: fp32 product (exact, the same operation as nv_dequant / mx_dequant before their last step), then bf16.
HD u32 nv_dequant_bf16(u32 code, float blk_scale) { return f32_to_bf16_rne(e2m1_value(code) * blk_scale); }
HD u32 mx_dequant_bf16(u32 code, float blk_scale, int elem) {
  float p = sf_value(code & 0x7fu, mx_mbits(elem), mx_bias(elem));
  if (code & 0x80u) p = -p;
  return f32_to_bf16_rne(p * blk_scale);
}
HD u64 ld_u64(const u8* p) {                                // p is 8-byte aligned (the Python dispatch guarantees it)
#ifdef __CUDA_ARCH__
  return *(const u64*)p;
#else
  u64 v = 0;
  for (int i = 0; i < 8; i++) v |= (u64)p[i] << (8 * i);
  return v;
#endif
}
// Tile loaders: 16 consecutive elements k16 .. k16+15 (k16 a multiple of 16) of row `row` of a K-padded operand, as
// 8 words of two bf16 each (element 2j in the low half, i.e. first in memory). All zero when !valid (a row outside
// the expert's range or beyond O) or k16 >= Kp (the last half of a 32-wide K step of an NVFP4 operand).
//   NVFP4: codes u8 [rows, Kp/2] (element 2i in the low nibble), E4M3 scales u8 [rows, Kp/16].
HD void nv_tile_load16(const u8* codes, const u8* scales, long long row, int k16, int Kp, bool valid, u32* out) {
  if (!valid || k16 >= Kp) { for (int j = 0; j < 8; j++) out[j] = 0u; return; }
  u64 packed = ld_u64(codes + row * (Kp / 2) + k16 / 2);
  float s = sf_value_e4m3(scales[row * (Kp / 16) + k16 / 16]);
  for (int j = 0; j < 8; j++) {
    u32 byte = (u32)(packed >> (8 * j)) & 0xffu;
    out[j] = nv_dequant_bf16(byte & 15u, s) | (nv_dequant_bf16(byte >> 4, s) << 16);
  }
}
//   MXFP8: elements u8 (E4M3 / E5M2 bits) [rows, Kp], E8M0 scales u8 [rows, Kp/32].
HD void mx_tile_load16(const u8* data, const u8* scales, long long row, int k16, int Kp, int elem, bool valid, u32* out) {
  if (!valid || k16 >= Kp) { for (int j = 0; j < 8; j++) out[j] = 0u; return; }
  const u8* p = data + row * Kp + k16;
  u64 lo = ld_u64(p), hi = ld_u64(p + 8);
  float s = e8m0_value(scales[row * (Kp / 32) + k16 / 32]);
  for (int j = 0; j < 8; j++) {
    u64 w = j < 4 ? lo : hi;
    int sh = 16 * (j & 3);
    out[j] = mx_dequant_bf16((u32)(w >> sh) & 0xffu, s, elem) | (mx_dequant_bf16((u32)(w >> (sh + 8)) & 0xffu, s, elem) << 16);
  }
}
// Epilogue of the NVFP4 kernel: the fp32 sum of (code x block scale) products times 1/S_enc of the A row, then of B.
HD float nv_epilogue(float acc, float a_senc, float b_senc) { return (acc * (1.0f / a_senc)) * (1.0f / b_senc); }

#endif  // LOWP_COMMON_CUH
