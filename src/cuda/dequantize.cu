// dequantize.cu - unpack + dequantize rows: uint8 [rows, packed_nbytes(n)] -> [rows, n]
// in fp32/bf16/fp16. One thread per 8-element group (a block's groups are handled by
// consecutive threads, so a warp covers whole blocks); no cross-thread cooperation.
#include "qcoll_common.cuh"

template <class T>
__device__ __forceinline__ void qc_dequantize_kernel(const qc_u8* buf, typename T::storage* out, qc_u64 rows,
                                                     qc_u64 n, int bits, int block, int vec) {
  const qc_u64 codes = qc_codes_nbytes(n, bits, block);
  const qc_u64 row_bytes = qc_packed_nbytes(n, bits, block);
  const qc_u64 groups = (n + QC_GROUP - 1) / QC_GROUP;  // per row; padding-only groups are skipped
  const qc_u64 tasks = rows * groups;
  const qc_u64 stride = (qc_u64)gridDim.x * blockDim.x;
  for (qc_u64 t = (qc_u64)blockIdx.x * blockDim.x + threadIdx.x; t < tasks; t += stride) {
    qc_u64 row = t / groups, e0 = (t % groups) * QC_GROUP;
    float v[QC_GROUP];
    qc_dequant_group(buf + row * row_bytes, e0, codes, bits, block, v);
    qc_store8<T>(out + row * n, e0, n, vec, v);
  }
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
