// quantize.cu - quantize + pack rows: x [rows, n] (fp32/bf16/fp16) -> uint8 [rows, packed_nbytes(n)].
#include "qcoll_memory.cuh"
#include "qcoll_block_quantize.cuh"

template <class T>
struct QcRowSource {
  const typename T::storage* x;
  qc_u64 n;
  int vec;
  __device__ __forceinline__ void load8(qc_u64 row, qc_u64 e0, float v[QC_GROUP]) const {
    qc_load8<T>(x + row * n, e0, n, vec, v);
  }
};

template <class T>
__device__ __forceinline__ void qc_quantize_kernel(const typename T::storage* x, qc_u8* out, qc_u64 rows,
                                                   qc_u64 n, int bits, int block, int vec, int stochastic,
                                                   qc_u32 seed, qc_u64 offset) {
  QcRowSource<T> src{x, n, vec};
  qc_quantize_rows_loop(src, rows, n, bits, block, out, stochastic, seed, offset);
}

#define QC_QUANTIZE(NAME, T)                                                                          \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                              \
      const T::storage* __restrict__ x, qc_u8* __restrict__ out, qc_u64 rows, qc_u64 n, int bits,      \
      int block, int vec, int stochastic, qc_u32 seed, qc_u64 offset) {                                \
    qc_quantize_kernel<T>(x, out, rows, n, bits, block, vec, stochastic, seed, offset);                \
  }

QC_QUANTIZE(qcoll_quantize_f32, QcF32)
QC_QUANTIZE(qcoll_quantize_bf16, QcBF16)
QC_QUANTIZE(qcoll_quantize_f16, QcF16)
