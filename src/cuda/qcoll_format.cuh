// qcoll_format.cuh - the wire-format math of the qcoll codec (docs/FORMAT.md), for host and device.
//
// Everything that decides a bit of the format lives here as __host__ __device__
// functions with no memory access: fp32 arithmetic that never contracts into FMA,
// dtype conversions, packed sizes and offsets, the stochastic-rounding hash,
// per-block scale / inverse, rounding, and bit packing. A host compiler (g++)
// builds the same code for the byte-for-byte tests (tests/host/qc_host_test.cpp).
// Also the base of the other headers: the QC_* macros and qc_* integer types.
//
// Included by: qcoll_memory.cuh, qcoll_block_quantize.cuh, every kernel (through
// them) and tests/host/qc_host_test.cpp.
// No standard headers are needed on the device side (NVRTC has none here).
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define QC_HD __host__ __device__ __forceinline__
#define QC_D __device__ __forceinline__
#define QC_IS_CUDA 1
#define QC_UNROLL _Pragma("unroll")
#else
#define QC_HD inline
#define QC_IS_CUDA 0
#define QC_UNROLL
#endif

typedef unsigned char qc_u8;
typedef unsigned short qc_u16;
typedef unsigned int qc_u32;
typedef unsigned long long qc_u64;

#define QC_FLT_MAX 3.40282346638528859812e+38f
#define QC_NAN_SCALE_BITS 0x7FC00000u
#define QC_GROUP 8  // elements handled by one thread at a time (packs to `bits` bytes)

// ---------------------------------------------------------------- fp32 arithmetic
// IEEE round-to-nearest-even operations, never contracted into FMA.
QC_HD float qc_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
QC_HD float qc_add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
QC_HD float qc_div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
QC_HD qc_u32 qc_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  qc_u32 u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
QC_HD float qc_u2f(qc_u32 u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}
QC_HD float qc_abs(float x) { return qc_u2f(qc_f2u(x) & 0x7FFFFFFFu); }
QC_HD bool qc_isnan(float x) { return (qc_f2u(x) & 0x7FFFFFFFu) > 0x7F800000u; }
QC_HD bool qc_isinf(float x) { return (qc_f2u(x) & 0x7FFFFFFFu) == 0x7F800000u; }
QC_HD bool qc_nonfinite(float x) { return (qc_f2u(x) & 0x7F800000u) == 0x7F800000u; }
// Round half to even (torch.round) and floor, in the default rounding mode.
QC_HD float qc_rint(float x) {
#ifdef __CUDA_ARCH__
  return rintf(x);
#else
  return __builtin_rintf(x);
#endif
}
QC_HD float qc_floor(float x) {
#ifdef __CUDA_ARCH__
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}
// Saturate to [-FLT_MAX, FLT_MAX]; NaN stays NaN (plain compares, not fminf/fmaxf).
QC_HD float qc_saturate(float v) {
  if (v > QC_FLT_MAX) return QC_FLT_MAX;
  if (v < -QC_FLT_MAX) return -QC_FLT_MAX;
  return v;
}

// ---------------------------------------------------------------- dtypes (as bits)
QC_HD float qc_bf16_to_f32(qc_u16 h) { return qc_u2f(((qc_u32)h) << 16); }
QC_HD qc_u16 qc_f32_to_bf16(float f) {
  qc_u32 u = qc_f2u(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (qc_u16)((u >> 16) | 0x0040u);  // quiet NaN stays NaN
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return (qc_u16)(u >> 16);
}

// Bit-exact software fp16 conversions (IEEE binary16, round to nearest even).
QC_HD float qc_f16_to_f32_soft(qc_u16 h) {
  qc_u32 sign = ((qc_u32)h & 0x8000u) << 16;
  qc_u32 e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0x1F) return qc_u2f(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return qc_u2f(sign);
    // subnormal: m * 2^-24, exact in fp32
    int sh = 0;
    while (!(m & 0x400u)) { m <<= 1; ++sh; }
    m &= 0x3FFu;
    return qc_u2f(sign | ((qc_u32)(113 - sh) << 23) | (m << 13));
  }
  return qc_u2f(sign | ((e + 112u) << 23) | (m << 13));
}
QC_HD qc_u16 qc_f32_to_f16_soft(float f) {
  qc_u32 u = qc_f2u(f);
  qc_u16 sign = (qc_u16)((u >> 16) & 0x8000u);
  qc_u32 a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (qc_u16)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN
  if (a >= 0x477FF000u) return (qc_u16)(sign | 0x7C00u);                         // >= 65520 -> inf
  qc_u32 e = a >> 23;
  if (e < 113) {  // result subnormal (or zero): units of 2^-24
    if (e < 102) return sign;  // < 2^-25 (or exactly half of the smallest with even 0) -> 0
    qc_u32 m = (a & 0x7FFFFFu) | 0x800000u;
    qc_u32 sh = 126 - e;  // 14..24
    qc_u32 r = m >> sh, rem = m & ((1u << sh) - 1u), half = 1u << (sh - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (qc_u16)(sign | r);
  }
  qc_u32 r = ((e - 112u) << 10) | ((a >> 13) & 0x3FFu);
  qc_u32 rem = a & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // carry into the exponent is correct
  return (qc_u16)(sign | r);
}
QC_HD float qc_f16_to_f32(qc_u16 h) {
#ifdef __CUDA_ARCH__
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return qc_f16_to_f32_soft(h);
#endif
}
QC_HD qc_u16 qc_f32_to_f16(float f) {
#ifdef __CUDA_ARCH__
  qc_u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return qc_f32_to_f16_soft(f);
#endif
}

// Element types: storage type plus conversions.
struct QcF32 {
  typedef float storage;
  static QC_HD float to_f32(float v) { return v; }
  static QC_HD float from_f32(float v) { return v; }
};
struct QcBF16 {
  typedef qc_u16 storage;
  static QC_HD float to_f32(qc_u16 v) { return qc_bf16_to_f32(v); }
  static QC_HD qc_u16 from_f32(float v) { return qc_f32_to_bf16(v); }
};
struct QcF16 {
  typedef qc_u16 storage;
  static QC_HD float to_f32(qc_u16 v) { return qc_f16_to_f32(v); }
  static QC_HD qc_u16 from_f32(float v) { return qc_f32_to_f16(v); }
};

// ---------------------------------------------------------------- format sizes
QC_HD int qc_qmax(int bits) { return (1 << (bits - 1)) - 1; }
QC_HD qc_u64 qc_num_blocks(qc_u64 n, qc_u64 block) { return (n + block - 1) / block; }
QC_HD qc_u64 qc_block_bytes(int bits, qc_u64 block) { return block * (qc_u64)bits / 8; }
QC_HD qc_u64 qc_codes_nbytes(qc_u64 n, int bits, qc_u64 block) {
  return qc_num_blocks(n, block) * qc_block_bytes(bits, block);
}
QC_HD qc_u64 qc_packed_nbytes(qc_u64 n, int bits, qc_u64 block) {
  return qc_num_blocks(n, block) * (qc_block_bytes(bits, block) + 4);
}
// Byte offset (within a row) of the codes of the 8-element group starting at element e0
// (e0 a multiple of 8): whole blocks before it plus whole groups inside its block.
QC_HD qc_u64 qc_group_code_offset(qc_u64 e0, int bits, qc_u64 block) {
  return (e0 / block) * qc_block_bytes(bits, block) + ((e0 % block) / QC_GROUP) * (qc_u64)bits;
}
// Source row of qgZ's swizzle: output row r = l * N + n holds slice (n, l) of [N, L, S].
QC_HD qc_u64 qc_swizzle_src_row(qc_u64 r, qc_u64 nodes, qc_u64 local) {
  qc_u64 l = r / nodes, nn = r % nodes;
  return nn * local + l;
}

// ---------------------------------------------------------------- stochastic hash
QC_HD qc_u32 qc_mix32(qc_u32 x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}
// u in [0, 1) for element index i (its position within the row, plus the offset).
QC_HD float qc_uniform(qc_u32 seed, qc_u64 i) {
  qc_u32 lo = (qc_u32)i, hi = (qc_u32)(i >> 32);
  qc_u32 h = qc_mix32(lo ^ qc_mix32(seed ^ qc_mix32(hi)));
  return (float)(h >> 8) * 5.9604644775390625e-08f;  // 2**-24, exact
}

// ---------------------------------------------------------------- per-block quantization
struct QcBlockParams {
  float scale;    // absmax / qmax
  float inv;      // qmax / absmax, 0 when absmax == 0
  int tiny;       // inv overflowed: codes from x / scale
  int nonfinite;  // block holds NaN or +-Inf
};

QC_HD QcBlockParams qc_block_params(float absmax, int nonfinite, int bits) {
  QcBlockParams p;
  float qm = (float)qc_qmax(bits);
  p.nonfinite = nonfinite;
  p.scale = qc_div(absmax, qm);
  p.inv = absmax == 0.0f ? 0.0f : qc_div(qm, absmax);
  p.tiny = (!nonfinite && qc_isinf(p.inv)) ? 1 : 0;
  return p;
}
QC_HD qc_u32 qc_scale_bits(const QcBlockParams& p) {
  return p.nonfinite ? QC_NAN_SCALE_BITS : qc_f2u(p.scale);
}
// One code (not yet masked). `u` is only read when stochastic.
QC_HD int qc_quantize_value(float x, const QcBlockParams& p, int bits, int stochastic, float u) {
  if (p.nonfinite) return 0;
  float t;
  if (p.tiny) {
    t = qc_div(x, p.scale);  // torch.nan_to_num(x / scale, nan=0.0)
    if (qc_isnan(t)) t = 0.0f;
    t = qc_saturate(t);
  } else {
    t = qc_mul(x, p.inv);
  }
  t = stochastic ? qc_floor(qc_add(t, u)) : qc_rint(t);
  float qm = (float)qc_qmax(bits);
  if (t > qm) t = qm;
  if (t < -qm) t = -qm;
  return (int)t;
}
// Pack 8 codes: value = OR_i (c_i & mask) << (bits * i), little-endian, `bits` bytes.
QC_HD qc_u64 qc_pack8(const int q[QC_GROUP], int bits) {
  qc_u64 w = 0, mask = (1ull << bits) - 1ull;
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) w |= ((qc_u64)(qc_u32)q[i] & mask) << (bits * i);
  return w;
}
QC_HD void qc_unpack8(qc_u64 w, int bits, int q[QC_GROUP]) {
  int mask = (1 << bits) - 1, half = 1 << (bits - 1);
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) {
    int c = (int)(w >> (bits * i)) & mask;
    q[i] = (c ^ half) - half;  // sign extend
  }
}
// Quantize and pack 8 consecutive elements whose first index (for the hash) is idx0.
QC_HD qc_u64 qc_quantize8(const float v[QC_GROUP], const QcBlockParams& p, int bits,
                          int stochastic, qc_u32 seed, qc_u64 idx0) {
  if (p.nonfinite) return 0;
  int q[QC_GROUP];
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) {
    float u = stochastic ? qc_uniform(seed, idx0 + (qc_u64)i) : 0.0f;
    q[i] = qc_quantize_value(v[i], p, bits, stochastic, u);
  }
  return qc_pack8(q, bits);
}
// Dequantize one code: q * scale in fp32, saturated, NaN preserved.
QC_HD float qc_dequant_value(int q, float scale) { return qc_saturate(qc_mul((float)q, scale)); }
QC_HD void qc_dequant8(qc_u64 w, float scale, int bits, float out[QC_GROUP]) {
  int q[QC_GROUP];
  qc_unpack8(w, bits, q);
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) out[i] = qc_dequant_value(q[i], scale);
}
// absmax / non-finite accumulation over a group (absmax only meaningful when finite).
QC_HD void qc_absmax8(const float v[QC_GROUP], float& absmax, int& nonfinite) {
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) {
    float a = qc_abs(v[i]);
    if (qc_nonfinite(a)) nonfinite = 1;
    else if (a > absmax) absmax = a;
  }
}
