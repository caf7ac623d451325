// reduce_requantize.cu - qgZ between and after the hops: k packed row sets
// uint8 [k, rows, nbytes_in] are dequantized and summed in fp32 as a left fold in k
// order, ((v0 + v1) + v2) + ..., then either written as fp32 [rows, n]
// (qcoll_dequantize_reduce) or quantized again with their own bits / block size /
// seed / offset (qcoll_reduce_requantize). No atomics: every output element is
// owned by one thread.
#include "qcoll_memory.cuh"
#include "qcoll_block_quantize.cuh"

// The fp32 sum of element group e0 .. e0+7 of `row` over the k inputs (zeros past n).
struct QcReduceSource {
  const qc_u8* bufs;
  qc_u64 k, rows, n;
  int bits;
  int block;
  qc_u64 codes_nbytes, row_bytes;
  __device__ __forceinline__ void load8(qc_u64 row, qc_u64 e0, float v[QC_GROUP]) const {
    qc_reduce_load8(bufs, k, rows * row_bytes, row_bytes, codes_nbytes, row, e0, n, bits, block, v);
  }
};

__device__ __forceinline__ QcReduceSource qc_reduce_source(const qc_u8* bufs, qc_u64 k, qc_u64 rows, qc_u64 n,
                                                          int bits, int block) {
  QcReduceSource s;
  s.bufs = bufs;
  s.k = k;
  s.rows = rows;
  s.n = n;
  s.bits = bits;
  s.block = block;
  s.codes_nbytes = qc_codes_nbytes(n, bits, block);
  s.row_bytes = qc_packed_nbytes(n, bits, block);
  return s;
}

extern "C" __global__ void __launch_bounds__(256)
    qcoll_dequantize_reduce(const qc_u8* __restrict__ bufs, float* __restrict__ out, qc_u64 k, qc_u64 rows,
                            qc_u64 n, int bits, int block, int vec) {
  const QcReduceSource src = qc_reduce_source(bufs, k, rows, n, bits, block);
  qc_dequantize_rows_loop<QcF32>(src, rows, n, out, vec);
}

// No __launch_bounds__ here: with it ptxas caps registers at 80 and spills 8 bytes.
extern "C" __global__ void qcoll_reduce_requantize(const qc_u8* __restrict__ bufs, qc_u8* __restrict__ out, qc_u64 k, qc_u64 rows,
                            qc_u64 n, int bits_in, int block_in, int bits_out, int block_out, int stochastic,
                            qc_u32 seed, qc_u64 offset) {
  const QcReduceSource src = qc_reduce_source(bufs, k, rows, n, bits_in, block_in);
  qc_quantize_rows_loop(src, rows, n, bits_out, block_out, out, stochastic, seed, offset);
}
