// hadamard.cu - block-local orthonormal Walsh-Hadamard rotation (docs/FORMAT.md, "Rotation"):
// fp32 [rows, n] -> fp32 [rows, n], every full `block` of a row multiplied by H_B / sqrt(B)
// in natural (Sylvester) order, the row's partial tail copied unchanged. One CTA per
// (row, block) at a time (grid-stride), the block in shared memory: log2(B) butterfly
// stages h = 1, 2, .., B/2, each pair (j, j + h) of a 2h group becoming (a + b, a - b)
// in round-to-nearest fp32 (qc_add; a - b as qc_add(a, -b), exact negation), then one
// multiplication by `scale` = fp32(1 / sqrt(B)): the torch reference's operations in
// the same order, so the results agree bit for bit. B <= 4096: 16 KiB of shared memory.
#include "qcoll_format.cuh"

#define QC_HADAMARD_THREADS 256
#define QC_HADAMARD_MAX_BLOCK 4096

extern "C" __global__ void __launch_bounds__(QC_HADAMARD_THREADS)
qcoll_hadamard_rows(const float* __restrict__ in, float* __restrict__ out, qc_u64 rows, qc_u64 n, int block,
                    float scale) {
  __shared__ float s[QC_HADAMARD_MAX_BLOCK];
  const qc_u64 B = (qc_u64)block;
  const qc_u64 full_blocks = n / B;
  const qc_u64 per_row = full_blocks + (n % B ? 1 : 0);  // the tail, if any, is one more work item
  const qc_u64 items = rows * per_row;
  for (qc_u64 item = blockIdx.x; item < items; item += gridDim.x) {
    const qc_u64 row = item / per_row, b = item % per_row;
    const float* src = in + row * n + b * B;
    float* dst = out + row * n + b * B;
    if (b == full_blocks) {  // the partial tail: copied as it is
      for (qc_u64 i = threadIdx.x; i < n - b * B; i += blockDim.x) dst[i] = src[i];
      continue;
    }
    for (int i = threadIdx.x; i < block; i += blockDim.x) s[i] = src[i];
    __syncthreads();
    for (int h = 1; h < block; h *= 2) {
      for (int p = threadIdx.x; p < block / 2; p += blockDim.x) {
        const int j = (p / h) * 2 * h + p % h;
        const float a = s[j], c = s[j + h];
        s[j] = qc_add(a, c);
        s[j + h] = qc_add(a, -c);
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < block; i += blockDim.x) dst[i] = qc_mul(s[i], scale);
    __syncthreads();  // s is reused by this CTA's next item
  }
}
