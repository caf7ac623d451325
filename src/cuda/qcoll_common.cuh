// qcoll_common.cuh - shared helpers of the qcoll CUDA kernels (docs/FORMAT.md).
//
// Everything that decides a bit of the wire format (index math, the stochastic
// rounding hash, per-block parameters, rounding, bit packing, dtype
// conversions) lives here as __host__ __device__ functions, so a host compiler
// (g++) can build the same code for the byte-for-byte tests in tests/host/.
// The device-only parts (warp shuffles, vector memory access) are guarded by
// __CUDA_ARCH__ / __CUDACC__.
//
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
typedef long long qc_i64;

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

// ---------------------------------------------------------------- memory (bytes)
// Packed rows are 4-byte aligned (the launcher guarantees it); the codes of an
// 8-element group start at a multiple of `bits` bytes inside a block, so they are
// 4-aligned for 4 and 8 bits, 2-aligned for 2 and 6 bits.
QC_HD qc_u64 qc_load_codes(const qc_u8* p, int bits) {
#ifdef __CUDA_ARCH__
  if (bits == 8) {
    if (((qc_u64)p & 7u) == 0) return *(const qc_u64*)p;
    const qc_u32* p32 = (const qc_u32*)p;
    return (qc_u64)p32[0] | ((qc_u64)p32[1] << 32);
  }
  if (bits == 4) return *(const qc_u32*)p;
  const qc_u16* p16 = (const qc_u16*)p;
  if (bits == 2) return p16[0];
  return (qc_u64)p16[0] | ((qc_u64)p16[1] << 16) | ((qc_u64)p16[2] << 32);
#else
  qc_u64 w = 0;
  for (int i = 0; i < bits; ++i) w |= (qc_u64)p[i] << (8 * i);
  return w;
#endif
}
QC_HD void qc_store_codes(qc_u8* p, qc_u64 w, int bits) {
#ifdef __CUDA_ARCH__
  if (bits == 8) {
    if (((qc_u64)p & 7u) == 0) { *(qc_u64*)p = w; return; }
    qc_u32* p32 = (qc_u32*)p;
    p32[0] = (qc_u32)w;
    p32[1] = (qc_u32)(w >> 32);
    return;
  }
  if (bits == 4) { *(qc_u32*)p = (qc_u32)w; return; }
  qc_u16* p16 = (qc_u16*)p;
  p16[0] = (qc_u16)w;
  if (bits == 6) {
    p16[1] = (qc_u16)(w >> 16);
    p16[2] = (qc_u16)(w >> 32);
  }
#else
  for (int i = 0; i < bits; ++i) p[i] = (qc_u8)(w >> (8 * i));
#endif
}
QC_HD float qc_load_scale(const qc_u8* p) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(*(const qc_u32*)p);
#else
  qc_u32 u = (qc_u32)p[0] | ((qc_u32)p[1] << 8) | ((qc_u32)p[2] << 16) | ((qc_u32)p[3] << 24);
  return qc_u2f(u);
#endif
}
QC_HD void qc_store_scale(qc_u8* p, qc_u32 bits) {
#ifdef __CUDA_ARCH__
  *(qc_u32*)p = bits;
#else
  for (int i = 0; i < 4; ++i) p[i] = (qc_u8)(bits >> (8 * i));
#endif
}

// Load 8 elements x[e0 .. e0+7] of a row of length n as fp32 (zeros past n).
// `vec`: the row base and n allow 16-byte loads of whole groups.
template <class T>
QC_HD void qc_load8(const typename T::storage* row, qc_u64 e0, qc_u64 n, int vec, float v[QC_GROUP]) {
#ifdef __CUDA_ARCH__
  if (vec && e0 + QC_GROUP <= n) {
    if (sizeof(typename T::storage) == 4) {
      const float4* p = (const float4*)(row + e0);
      float4 a = p[0], b = p[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
      uint4 a = *(const uint4*)(row + e0);
      qc_u32 w[4] = {a.x, a.y, a.z, a.w};
QC_UNROLL
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = T::to_f32((typename T::storage)(w[i] & 0xFFFFu));
        v[2 * i + 1] = T::to_f32((typename T::storage)(w[i] >> 16));
      }
    }
    return;
  }
#endif
  (void)vec;
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) {
    qc_u64 e = e0 + (qc_u64)i;
    v[i] = e < n ? T::to_f32(row[e]) : 0.0f;
  }
}
// Store 8 fp32 values as T at row[e0 ..], only those below n.
template <class T>
QC_HD void qc_store8(typename T::storage* row, qc_u64 e0, qc_u64 n, int vec, const float v[QC_GROUP]) {
#ifdef __CUDA_ARCH__
  if (vec && e0 + QC_GROUP <= n) {
    if (sizeof(typename T::storage) == 4) {
      float4* p = (float4*)(row + e0);
      p[0] = make_float4(v[0], v[1], v[2], v[3]);
      p[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      qc_u32 w[4];
QC_UNROLL
      for (int i = 0; i < 4; ++i)
        w[i] = (qc_u32)T::from_f32(v[2 * i]) | ((qc_u32)T::from_f32(v[2 * i + 1]) << 16);
      *(uint4*)(row + e0) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
#endif
  (void)vec;
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i) {
    qc_u64 e = e0 + (qc_u64)i;
    if (e < n) row[e] = T::from_f32(v[i]);
  }
}

// Dequantize the 8 elements starting at e0 of one packed row (no bound: padding
// elements come out as q * scale, callers mask them).
QC_HD void qc_dequant_group(const qc_u8* prow, qc_u64 e0, qc_u64 codes_nbytes, int bits,
                            qc_u64 block, float out[QC_GROUP]) {
  qc_u64 w = qc_load_codes(prow + qc_group_code_offset(e0, bits, block), bits);
  float scale = qc_load_scale(prow + codes_nbytes + (e0 / block) * 4u);
  qc_dequant8(w, scale, bits, out);
}

// The fp32 sum over k packed row sets (set j at bufs + j * set_bytes) of elements
// e0 .. e0+7 of `row`: a left fold in set order, each addition rounded to fp32.
// Elements at or past n are 0 (the sum is cut to n, then re-padded with zeros).
QC_HD void qc_reduce_load8(const qc_u8* bufs, qc_u64 k, qc_u64 set_bytes, qc_u64 row_bytes,
                           qc_u64 codes_nbytes, qc_u64 row, qc_u64 e0, qc_u64 n, int bits, int block,
                           float v[QC_GROUP]) {
  if (e0 >= n) {
QC_UNROLL
    for (int i = 0; i < QC_GROUP; ++i) v[i] = 0.0f;
    return;
  }
  const qc_u8* p = bufs + row * row_bytes;
  qc_dequant_group(p, e0, codes_nbytes, bits, block, v);
  for (qc_u64 j = 1; j < k; ++j) {
    float w[QC_GROUP];
    qc_dequant_group(p + j * set_bytes, e0, codes_nbytes, bits, block, w);
QC_UNROLL
    for (int i = 0; i < QC_GROUP; ++i) v[i] = qc_add(v[i], w[i]);
  }
QC_UNROLL
  for (int i = 0; i < QC_GROUP; ++i)
    if (e0 + (qc_u64)i >= n) v[i] = 0.0f;
}

// ---------------------------------------------------------------- device: block quantizer
#if QC_IS_CUDA
// Thread group geometry: T = min(32, block/8) threads quantize one block together.
QC_D int qc_group_threads(int block) { return block / QC_GROUP < 32 ? block / QC_GROUP : 32; }
QC_D unsigned qc_group_mask(int T, int lane_in_warp) {
  if (T == 32) return 0xFFFFFFFFu;
  return ((1u << T) - 1u) << (lane_in_warp & ~(T - 1));
}

// Quantize block `blk` of row `row` whose values come from `src.load8(row, e0, v)`
// (zeros past n). The T threads of the group call this together; `lane` in [0, T).
// Pass 1 finds absmax (the first 8-element group of each thread stays in
// registers), pass 2 reloads any further groups, quantizes and packs them.
template <class Src>
__device__ __forceinline__ void qc_quantize_block(const Src& src, qc_u64 row, qc_u64 blk, int bits, int block,
                                                  qc_u8* out_row, qc_u64 codes_nbytes, int stochastic,
                                                  qc_u32 seed, qc_u64 offset, int lane, int T,
                                                  unsigned mask) {
  const int per_thread = block / QC_GROUP / T;
  const qc_u64 base = blk * (qc_u64)block;
  float first[QC_GROUP];
  float absmax = 0.0f;
  int nonfinite = 0;
  for (int i = 0; i < per_thread; ++i) {
    qc_u64 e0 = base + (qc_u64)(i * T + lane) * QC_GROUP;
    float v[QC_GROUP];
    src.load8(row, e0, v);
    qc_absmax8(v, absmax, nonfinite);
    if (i == 0) {
QC_UNROLL
      for (int k = 0; k < QC_GROUP; ++k) first[k] = v[k];
    }
  }
  for (int o = T >> 1; o > 0; o >>= 1) {
    float other = __shfl_xor_sync(mask, absmax, o, T);
    absmax = other > absmax ? other : absmax;
  }
  nonfinite = __any_sync(mask, nonfinite);
  const QcBlockParams p = qc_block_params(absmax, nonfinite, bits);
  for (int i = 0; i < per_thread; ++i) {
    qc_u64 e0 = base + (qc_u64)(i * T + lane) * QC_GROUP;
    float v[QC_GROUP];
    if (i == 0) {
QC_UNROLL
      for (int k = 0; k < QC_GROUP; ++k) v[k] = first[k];
    } else {
      src.load8(row, e0, v);
    }
    qc_u64 w = qc_quantize8(v, p, bits, stochastic, seed, offset + e0);
    qc_store_codes(out_row + qc_group_code_offset(e0, bits, block), w, bits);
  }
  if (lane == 0) qc_store_scale(out_row + codes_nbytes + blk * 4u, qc_scale_bits(p));
}

// Grid-stride loop over (row, block) tasks, one task per thread group.
template <class Src>
__device__ __forceinline__ void qc_quantize_rows_loop(const Src& src, qc_u64 rows, qc_u64 n, int bits, int block,
                                                      qc_u8* out, int stochastic, qc_u32 seed,
                                                      qc_u64 offset) {
  const int T = qc_group_threads(block);
  const int lane_w = threadIdx.x & 31;
  const int lane = lane_w & (T - 1);
  const unsigned mask = qc_group_mask(T, lane_w);
  const qc_u64 nb = qc_num_blocks(n, block);
  const qc_u64 codes = qc_codes_nbytes(n, bits, block);
  const qc_u64 row_bytes = qc_packed_nbytes(n, bits, block);
  const qc_u64 tasks = rows * nb;
  const qc_u64 gid = ((qc_u64)blockIdx.x * blockDim.x + threadIdx.x) / (qc_u64)T;
  const qc_u64 stride = ((qc_u64)gridDim.x * blockDim.x) / (qc_u64)T;
  for (qc_u64 t = gid; t < tasks; t += stride) {
    qc_u64 row = t / nb, blk = t % nb;
    qc_quantize_block(src, row, blk, bits, block, out + row * row_bytes, codes, stochastic, seed, offset,
                      lane, T, mask);
  }
}
#endif  // QC_IS_CUDA
