// qcoll_block_quantize.cuh - the device-side loops the kernels are made of (device only).
//
// The warp-cooperative block quantizer (T = min(32, block/8) threads per block,
// absmax by warp shuffles) with its grid-stride loop over (row, block) tasks, and
// the one grid-stride dequantize loop over (row, 8-element group) tasks. Both take
// a source `src` with `src.load8(row, e0, v)` (8 fp32 values, zeros past n), so a
// kernel only says where its values come from: a plain row (quantize.cu), a
// swizzled row (swizzle_quantize.cu), one packed row (dequantize.cu) or the sum of
// k packed rows (reduce_requantize.cu).
//
// Included by the kernels (src/cuda/*.cu); not by the host test (it needs CUDA).
#pragma once

#include "qcoll_format.cuh"
#include "qcoll_memory.cuh"

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

// ---------------------------------------------------------------- device: dequantize loop
// Grid-stride loop over (row, 8-element group) tasks, one thread per group (a
// block's groups go to consecutive threads, so a warp covers whole blocks; no
// cross-thread cooperation): out[row, e0 ..] = src.load8(row, e0) as T, only
// elements below n. Groups made only of padding are skipped.
template <class T, class Src>
__device__ __forceinline__ void qc_dequantize_rows_loop(const Src& src, qc_u64 rows, qc_u64 n,
                                                        typename T::storage* out, int vec) {
  const qc_u64 groups = (n + QC_GROUP - 1) / QC_GROUP;  // per row
  const qc_u64 tasks = rows * groups;
  const qc_u64 stride = (qc_u64)gridDim.x * blockDim.x;
  for (qc_u64 t = (qc_u64)blockIdx.x * blockDim.x + threadIdx.x; t < tasks; t += stride) {
    qc_u64 row = t / groups, e0 = (t % groups) * QC_GROUP;
    float v[QC_GROUP];
    src.load8(row, e0, v);
    qc_store8<T>(out + row * n, e0, n, vec, v);
  }
}
#endif  // QC_IS_CUDA
