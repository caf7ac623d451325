// dequantize.cu - unpack + dequantize rows: uint8 [rows, packed_nbytes(n)] -> [rows, n]
// in fp32/bf16/fp16. One thread per 8-element group (qc_dequantize_rows_loop, shared
// with qcoll_dequantize_reduce); no cross-thread cooperation.
#include "qcoll_memory.cuh"
#include "qcoll_block_quantize.cuh"

// Element group e0 .. e0+7 of packed row `row`, dequantized (padding too: the loop masks it).
struct QcPackedSource {
  const qc_u8* buf;
  qc_u64 codes_nbytes, row_bytes;
  int bits;
  int block;
  __device__ __forceinline__ void load8(qc_u64 row, qc_u64 e0, float v[QC_GROUP]) const {
    qc_dequant_group(buf + row * row_bytes, e0, codes_nbytes, bits, block, v);
  }
};

template <class T>
__device__ __forceinline__ void qc_dequantize_kernel(const qc_u8* buf, typename T::storage* out, qc_u64 rows,
                                                     qc_u64 n, int bits, int block, int vec) {
  const QcPackedSource src{buf, qc_codes_nbytes(n, bits, block), qc_packed_nbytes(n, bits, block), bits, block};
  qc_dequantize_rows_loop<T>(src, rows, n, out, vec);
}

#define QC_DEQUANTIZE(NAME, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(256) NAME(const qc_u8* __restrict__ buf,           \
                                                         T::storage* __restrict__ out, qc_u64 rows, \
                                                         qc_u64 n, int bits, int block, int vec) {  \
    qc_dequantize_kernel<T>(buf, out, rows, n, bits, block, vec);                                 \
  }

QC_DEQUANTIZE(qcoll_dequantize_f32, QcF32)
QC_DEQUANTIZE(qcoll_dequantize_bf16, QcBF16)
QC_DEQUANTIZE(qcoll_dequantize_f16, QcF16)
