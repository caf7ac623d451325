// swizzle_quantize.cu - qgZ step 1: view flat x as [N, L, S]; output row l * N + n is
// slice (n, l) quantized on its own: uint8 [L * N, packed_nbytes(S)]. The reorder is
// fused into the loads (no transposed copy).
#include "qcoll_memory.cuh"
#include "qcoll_block_quantize.cuh"

template <class T>
struct QcSwizzleSource {
  const typename T::storage* x;
  qc_u64 s;  // slice length S (the row length n)
  qc_u64 nodes, local;
  int vec;
  __device__ __forceinline__ void load8(qc_u64 row, qc_u64 e0, float v[QC_GROUP]) const {
    qc_load8<T>(x + qc_swizzle_src_row(row, nodes, local) * s, e0, s, vec, v);
  }
};

#define QC_SWIZZLE(NAME, T)                                                                           \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                              \
      const T::storage* __restrict__ x, qc_u8* __restrict__ out, qc_u64 nodes, qc_u64 local, qc_u64 s, \
      int bits, int block, int vec, int stochastic, qc_u32 seed, qc_u64 offset) {                      \
    QcSwizzleSource<T> src{x, s, nodes, local, vec};                                                   \
    qc_quantize_rows_loop(src, nodes * local, s, bits, block, out, stochastic, seed, offset);          \
  }

QC_SWIZZLE(qcoll_swizzle_quantize_f32, QcF32)
QC_SWIZZLE(qcoll_swizzle_quantize_bf16, QcBF16)
QC_SWIZZLE(qcoll_swizzle_quantize_f16, QcF16)
