// qcoll_memory.cuh - memory access of the qcoll kernels: codes, scales and elements.
//
// Vector loads and stores of packed codes (by `bits`), fp32 scales and 8-element
// groups of fp32/bf16/fp16 rows (16-byte loads of whole groups when `vec`), and
// the two readers of packed rows as fp32 groups: one row (qc_dequant_group) and
// the fp32 sum over k row sets (qc_reduce_load8). __host__ __device__: on the
// device the accesses are vectorized (guarded by __CUDA_ARCH__), on the host they
// go byte by byte, so tests/host/qc_host_test.cpp runs the same compositions.
//
// Included by: qcoll_block_quantize.cuh, the kernels and tests/host/qc_host_test.cpp.
#pragma once

#include "qcoll_format.cuh"

// ---------------------------------------------------------------- codes and scales (bytes)
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

// ---------------------------------------------------------------- elements (fp32 / bf16 / fp16 rows)
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

// ---------------------------------------------------------------- packed rows as fp32 groups
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
