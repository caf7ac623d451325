/* qcoll's CPU codec kernels: quantize and dequantize whole blocks of the wire format
 * (docs/FORMAT.md), byte-identical to qcoll/quant/reference.py.
 *
 * Plain C99, no torch, no OpenMP: qcoll/bindings/cpu.py compiles this file once with the
 * system compiler (-O3 -ffp-contract=off -fno-math-errno -fno-trapping-math, never
 * -ffast-math: no result may change a bit), loads it with ctypes and calls it on contiguous
 * ranges of blocks from a few threads. The loops are written for the auto-vectorizer.
 *
 * A "block index" i in [start, end) names block i % per_row of row i / per_row. Each row
 * has its own base pointer stride (elements for floats, bytes for the packed sections).
 * Only round-to-nearest, 8/4/2 bits, whole blocks of 32..4096 elements (a power of two).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NAN_SCALE_BITS 0x7FC00000u
#define ABS_MASK 0x7FFFFFFFu
#define INF_BITS 0x7F800000u
#define MAX_BLOCK 4096

static float bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* The largest |x| of a block as fp32 bits; NaN bits order above Inf, so >= INF_BITS means
 * the block holds a NaN or an infinity. */
static uint32_t absmax_bits(const float *restrict x, int block)
{
    uint32_t m = 0;
    for (int i = 0; i < block; i++) {
        uint32_t a;
        memcpy(&a, x + i, 4);  /* the bits (no pointer cast: strict aliasing) */
        a &= ABS_MASK;
        m = a > m ? a : m;
    }
    return m;
}

/* rint(t) for |t| < 2**22 in the default rounding mode (to nearest, ties to even, as torch.round).
 * Where the CPU has no vector round instruction (x86 without SSE4.1) rintf is a scalar loop; there
 * t + 1.5 * 2**23 lands in [2**23, 2**24), where fp32 spacing is 1, so the addition itself rounds t
 * to an integer (ties to even: the constant is even) and the subtraction is exact. Quantize needs
 * no more range: |x| <= absmax and inv = qmax / absmax rounded, so |x * inv| <= 127 * (1 + 2**-24)**2. */
static float round_even(float t)
{
#if defined(__SSE2__) && !defined(__SSE4_1__)
    return (t + 12582912.0f) - 12582912.0f;
#else
    return rintf(t);
#endif
}

/* Rounded, clamped codes of one block into int8 q: clamp(rint(x * inv), -qm, qm). */
static void block_codes(const float *restrict x, int block, float inv, int32_t qm, int8_t *restrict q)
{
    for (int i = 0; i < block; i++) {
        int32_t c = (int32_t)round_even(x[i] * inv);
        c = c > qm ? qm : c;
        c = c < -qm ? -qm : c;
        q[i] = (int8_t)c;
    }
}

/* Pack int8 codes into bytes: 4 bits two per byte (element 2k low), 2 bits four per byte
 * (element 4k+j at bit 2j), each byte from one 16- or 32-bit little-endian word of codes. */
static void pack_codes(const int8_t *restrict q, int block, int bits, uint8_t *restrict out)
{
    if (bits == 4) {
        for (int k = 0; k < block / 2; k++) {
            uint16_t w; memcpy(&w, q + 2 * k, 2);
            out[k] = (uint8_t)((w & 0xF) | ((w >> 4) & 0xF0));
        }
    } else {
        for (int k = 0; k < block / 4; k++) {
            uint32_t w; memcpy(&w, q + 4 * k, 4);
            out[k] = (uint8_t)((w & 0x3) | ((w >> 6) & 0xC) | ((w >> 12) & 0x30) | ((w >> 18) & 0xC0));
        }
    }
}

/* One block: returns 1 when it is in the subnormal range (a finite absmax whose 1/scale is
 * infinite; the reference handles those), else writes its codes and scale and returns 0. */
static int quantize_block(const float *restrict x, int block, int bits, uint8_t *restrict codes,
                          uint8_t *restrict scale_out)
{
    int8_t q[MAX_BLOCK];
    const int32_t qm = (1 << (bits - 1)) - 1;
    const float qmf = (float)qm;
    const uint32_t m = absmax_bits(x, block);
    uint32_t sbits = NAN_SCALE_BITS;
    if (m >= INF_BITS) {  /* NaN or Inf: codes 0, the NaN scale */
        memset(codes, 0, (size_t)block * bits / 8);
    } else {
        const float absmax = bits_to_float(m);
        const float inv = m == 0 ? 0.0f : qmf / absmax;
        if (isinf(inv))
            return 1;
        sbits = float_to_bits(absmax / qmf);
        if (bits == 8) {
            block_codes(x, block, inv, qm, (int8_t *)codes);
        } else {
            block_codes(x, block, inv, qm, q);
            pack_codes(q, block, bits, codes);
        }
    }
    memcpy(scale_out, &sbits, 4);
    return 0;
}

/* Quantize blocks [start, end) (see the file comment; start and end come last so that a
 * caller binds the rest once and splits the range). x: fp32 rows, x_stride elements apart;
 * codes / scales: each row's codes and scale sections, codes_stride / scales_stride bytes
 * apart. Returns the number of subnormal-range blocks met (it stops at the first: the caller
 * then runs the reference on everything). */
int64_t qcoll_quantize_blocks(const float *x, int64_t x_stride, uint8_t *codes, int64_t codes_stride,
                              uint8_t *scales, int64_t scales_stride, int64_t per_row,
                              int32_t block, int32_t bits, int64_t start, int64_t end)
{
    const int64_t bb = (int64_t)block * bits / 8;
    for (int64_t i = start; i < end; i++) {
        const int64_t r = i / per_row, b = i % per_row;
        if (quantize_block(x + r * x_stride + b * block, block, bits, codes + r * codes_stride + b * bb,
                           scales + r * scales_stride + 4 * b))
            return 1;
    }
    return 0;
}

/* q * scale saturated to [-FLT_MAX, FLT_MAX]; NaN stays NaN (the comparisons are false). */
static float scaled(int32_t q, float s)
{
    float v = (float)q * s;
    v = v > 3.40282347e38f ? 3.40282347e38f : v;
    v = v < -3.40282347e38f ? -3.40282347e38f : v;
    return v;
}

/* Signed codes of one packed block into int8 q (4 and 2 bits: one byte -> two / four codes). */
static void unpack_codes(const uint8_t *restrict c, int block, int bits, int8_t *restrict q)
{
    if (bits == 4) {
        for (int k = 0; k < block / 2; k++) {
            q[2 * k] = (int8_t)(((c[k] & 0xF) ^ 8) - 8);
            q[2 * k + 1] = (int8_t)(((c[k] >> 4) ^ 8) - 8);
        }
    } else {
        for (int k = 0; k < block / 4; k++)
            for (int j = 0; j < 4; j++)
                q[4 * k + j] = (int8_t)((((c[k] >> (2 * j)) & 3) ^ 2) - 2);
    }
}

/* fp32 -> bf16 bits as torch rounds (to nearest even; NaN -> 0x7FC0). */
static uint16_t to_bf16(float v)
{
    const uint32_t u = float_to_bits(v);
    const uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return v != v ? (uint16_t)0x7FC0 : r;
}

/* Dequantize blocks [start, end) (see the file comment) into out (fp32 when out_bf16 is 0,
 * else bf16 bits), rows out_stride elements apart. */
void qcoll_dequantize_blocks(const uint8_t *codes, int64_t codes_stride, const uint8_t *scales,
                             int64_t scales_stride, void *out, int64_t out_stride, int32_t out_bf16,
                             int64_t per_row, int32_t block, int32_t bits, int64_t start, int64_t end)
{
    int8_t buf[MAX_BLOCK];
    const int64_t bb = (int64_t)block * bits / 8;
    for (int64_t i = start; i < end; i++) {
        const int64_t r = i / per_row, b = i % per_row;
        const uint8_t *c = codes + r * codes_stride + b * bb;
        float s;
        memcpy(&s, scales + r * scales_stride + 4 * b, 4);
        const int8_t *restrict q = (const int8_t *)c;
        if (bits != 8) {
            unpack_codes(c, block, bits, buf);
            q = buf;
        }
        const int64_t at = r * out_stride + b * block;
        if (out_bf16) {
            uint16_t *restrict o = (uint16_t *)out + at;
            for (int k = 0; k < block; k++)
                o[k] = to_bf16(scaled(q[k], s));
        } else {
            float *restrict o = (float *)out + at;
            for (int k = 0; k < block; k++)
                o[k] = scaled(q[k], s);
        }
    }
}

/* Running on the OpenMP runtime that the host process (torch) already loaded, never a second
 * one: the caller passes that runtime's GOMP_parallel and its thread queries (libgomp, and
 * LLVM's / Intel's libomp export the same GOMP entry points). Each thread of the team takes
 * one contiguous range of blocks; results[t] is thread t's return value (0 where none ran). */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);

struct job {
    const void *in;        /* x (quantize) or codes (dequantize) */
    int64_t in_stride;
    void *out;             /* codes (quantize) or values (dequantize) */
    int64_t out_stride;
    uint8_t *scales;
    int64_t scales_stride;
    int64_t per_row, nblocks;
    int32_t block, bits, out_bf16, quantize;
    omp_int_fn thread_num, num_threads;
    int64_t *results;
};

static void job_body(void *arg)
{
    const struct job *j = (const struct job *)arg;
    const int64_t t = j->thread_num(), n = j->num_threads();
    const int64_t start = j->nblocks * t / n, end = j->nblocks * (t + 1) / n;
    if (j->quantize)
        j->results[t] = qcoll_quantize_blocks((const float *)j->in, j->in_stride, (uint8_t *)j->out,
                                              j->out_stride, j->scales, j->scales_stride, j->per_row,
                                              j->block, j->bits, start, end);
    else
        qcoll_dequantize_blocks((const uint8_t *)j->in, j->in_stride, j->scales, j->scales_stride, j->out,
                                j->out_stride, j->out_bf16, j->per_row, j->block, j->bits, start, end);
}

/* qcoll_quantize_blocks over blocks [0, nblocks) on up to nthreads threads of the given
 * runtime; returns the number of threads that met a subnormal-range block. results: nthreads
 * zeroed slots. */
int64_t qcoll_quantize_parallel(const float *x, int64_t x_stride, uint8_t *codes, int64_t codes_stride,
                                uint8_t *scales, int64_t scales_stride, int64_t per_row, int32_t block,
                                int32_t bits, int64_t nblocks, int32_t nthreads, gomp_parallel_fn parallel,
                                omp_int_fn thread_num, omp_int_fn num_threads, int64_t *results)
{
    struct job j = {x, x_stride, codes, codes_stride, scales, scales_stride, per_row, nblocks,
                    block, bits, 0, 1, thread_num, num_threads, results};
    int64_t tiny = 0;
    parallel(job_body, &j, (unsigned)nthreads, 0);
    for (int32_t t = 0; t < nthreads; t++)
        tiny += results[t] != 0;
    return tiny;
}

/* qcoll_dequantize_blocks over blocks [0, nblocks) on up to nthreads threads (see above). */
void qcoll_dequantize_parallel(const uint8_t *codes, int64_t codes_stride, const uint8_t *scales,
                               int64_t scales_stride, void *out, int64_t out_stride, int32_t out_bf16,
                               int64_t per_row, int32_t block, int32_t bits, int64_t nblocks, int32_t nthreads,
                               gomp_parallel_fn parallel, omp_int_fn thread_num, omp_int_fn num_threads,
                               int64_t *results)
{
    struct job j = {codes, codes_stride, out, out_stride, (uint8_t *)scales, scales_stride, per_row,
                    nblocks, block, bits, out_bf16, 0, thread_num, num_threads, results};
    parallel(job_body, &j, (unsigned)nthreads, 0);
}
