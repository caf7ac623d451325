// Host driver for tests/test_cuda_host_helpers.py: runs the __host__ __device__
// helpers of src/cuda/qcoll_format.cuh and src/cuda/qcoll_memory.cuh on the CPU,
// composed the way the kernels compose them, on binary inputs written by the test;
// the test compares the output bytes with the torch reference.
//
// usage: qc_host_test MODE IN OUT [ints...]
//   mix                                         u32 -> u32 (mix32)
//   uniform   seed offset count                 -> f32 (IN unused)
//   cvt       kind                              kind: f2bf f2h (f32 -> u16), bf2f h2f (u16 -> f32)
//   quant     dtype rows n bits block stoch seed offset         dtype: 0 f32, 1 bf16, 2 f16
//   swizzle   dtype nodes local s bits block stoch seed offset
//   dequant   dtype rows n bits block
//   reduce    k rows n bits block                               -> f32 [rows, n]
//   requant   k rows n bits_in block_in bits_out block_out stoch seed offset
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "qcoll_format.cuh"
#include "qcoll_memory.cuh"

static std::vector<unsigned char> read_all(const char* path) {
  std::vector<unsigned char> d;
  FILE* f = std::fopen(path, "rb");
  if (!f) return d;
  unsigned char buf[65536];
  size_t r;
  while ((r = std::fread(buf, 1, sizeof buf, f)) > 0) d.insert(d.end(), buf, buf + r);
  std::fclose(f);
  return d;
}
static void write_all(const char* path, const void* p, size_t nbytes) {
  FILE* f = std::fopen(path, "wb");
  if (!f) { std::perror(path); std::exit(2); }
  if (nbytes) std::fwrite(p, 1, nbytes, f);
  std::fclose(f);
}

// Quantize one row the way qc_quantize_block does (T = 1 thread per block here;
// the group size does not change any result: absmax is a max, order-free).
template <class T, class Load>
static void quantize_row(Load load, qc_u64 n, int bits, int block, qc_u8* out_row, int stoch, qc_u32 seed,
                         qc_u64 offset) {
  qc_u64 nb = qc_num_blocks(n, block), codes = qc_codes_nbytes(n, bits, block);
  for (qc_u64 b = 0; b < nb; ++b) {
    float absmax = 0.0f;
    int nonfinite = 0;
    for (int g = 0; g < block / QC_GROUP; ++g) {
      float v[QC_GROUP];
      load(b * block + (qc_u64)g * QC_GROUP, v);
      qc_absmax8(v, absmax, nonfinite);
    }
    QcBlockParams p = qc_block_params(absmax, nonfinite, bits);
    for (int g = 0; g < block / QC_GROUP; ++g) {
      qc_u64 e0 = b * block + (qc_u64)g * QC_GROUP;
      float v[QC_GROUP];
      load(e0, v);
      qc_store_codes(out_row + qc_group_code_offset(e0, bits, block), qc_quantize8(v, p, bits, stoch, seed, offset + e0),
                     bits);
    }
    qc_store_scale(out_row + codes + b * 4, qc_scale_bits(p));
  }
}

template <class T>
static void run_quant(const std::vector<unsigned char>& in, const char* outp, qc_u64 rows, qc_u64 n, int bits,
                      int block, int stoch, qc_u32 seed, qc_u64 offset) {
  const typename T::storage* x = (const typename T::storage*)in.data();
  qc_u64 rb = qc_packed_nbytes(n, bits, block);
  std::vector<qc_u8> out(rows * rb, 0xEE);
  for (qc_u64 r = 0; r < rows; ++r) {
    const typename T::storage* row = x + r * n;
    quantize_row<T>([&](qc_u64 e0, float* v) { qc_load8<T>(row, e0, n, 0, v); }, n, bits, block,
                    out.data() + r * rb, stoch, seed, offset);
  }
  write_all(outp, out.data(), out.size());
}

template <class T>
static void run_swizzle(const std::vector<unsigned char>& in, const char* outp, qc_u64 nodes, qc_u64 local,
                        qc_u64 s, int bits, int block, int stoch, qc_u32 seed, qc_u64 offset) {
  const typename T::storage* x = (const typename T::storage*)in.data();
  qc_u64 rb = qc_packed_nbytes(s, bits, block), rows = nodes * local;
  std::vector<qc_u8> out(rows * rb, 0xEE);
  for (qc_u64 r = 0; r < rows; ++r) {
    const typename T::storage* row = x + qc_swizzle_src_row(r, nodes, local) * s;
    quantize_row<T>([&](qc_u64 e0, float* v) { qc_load8<T>(row, e0, s, 0, v); }, s, bits, block,
                    out.data() + r * rb, stoch, seed, offset);
  }
  write_all(outp, out.data(), out.size());
}

template <class T>
static void run_dequant(const std::vector<unsigned char>& in, const char* outp, qc_u64 rows, qc_u64 n, int bits,
                        int block) {
  qc_u64 rb = qc_packed_nbytes(n, bits, block), codes = qc_codes_nbytes(n, bits, block);
  std::vector<typename T::storage> out(rows * n);
  for (qc_u64 r = 0; r < rows; ++r)
    for (qc_u64 e0 = 0; e0 < n; e0 += QC_GROUP) {
      float v[QC_GROUP];
      qc_dequant_group(in.data() + r * rb, e0, codes, bits, block, v);
      qc_store8<T>(out.data() + r * n, e0, n, 0, v);
    }
  write_all(outp, out.data(), out.size() * sizeof(typename T::storage));
}

int main(int argc, char** argv) {
  if (argc < 4) { std::fprintf(stderr, "usage: %s MODE IN OUT [args]\n", argv[0]); return 2; }
  std::string mode = argv[1];
  std::vector<unsigned char> in = read_all(argv[2]);
  const char* outp = argv[3];
  std::vector<unsigned long long> a;
  for (int i = 4; i < argc; ++i) a.push_back(std::strtoull(argv[i], nullptr, 0));
  if (mode == "mix") {
    std::vector<qc_u32> out(in.size() / 4);
    for (size_t i = 0; i < out.size(); ++i) out[i] = qc_mix32(((const qc_u32*)in.data())[i]);
    write_all(outp, out.data(), out.size() * 4);
  } else if (mode == "uniform") {
    std::vector<float> out(a[2]);
    for (size_t i = 0; i < out.size(); ++i) out[i] = qc_uniform((qc_u32)a[0], a[1] + i);
    write_all(outp, out.data(), out.size() * 4);
  } else if (mode == "cvt") {
    int kind = (int)a[0];  // 0 f2bf, 1 f2h, 2 bf2f, 3 h2f
    if (kind <= 1) {
      std::vector<qc_u16> out(in.size() / 4);
      for (size_t i = 0; i < out.size(); ++i) {
        float f = ((const float*)in.data())[i];
        out[i] = kind == 0 ? qc_f32_to_bf16(f) : qc_f32_to_f16(f);
      }
      write_all(outp, out.data(), out.size() * 2);
    } else {
      std::vector<float> out(in.size() / 2);
      for (size_t i = 0; i < out.size(); ++i) {
        qc_u16 h = ((const qc_u16*)in.data())[i];
        out[i] = kind == 2 ? qc_bf16_to_f32(h) : qc_f16_to_f32(h);
      }
      write_all(outp, out.data(), out.size() * 4);
    }
  } else if (mode == "quant") {
    int dt = (int)a[0];
    if (dt == 0) run_quant<QcF32>(in, outp, a[1], a[2], (int)a[3], (int)a[4], (int)a[5], (qc_u32)a[6], a[7]);
    if (dt == 1) run_quant<QcBF16>(in, outp, a[1], a[2], (int)a[3], (int)a[4], (int)a[5], (qc_u32)a[6], a[7]);
    if (dt == 2) run_quant<QcF16>(in, outp, a[1], a[2], (int)a[3], (int)a[4], (int)a[5], (qc_u32)a[6], a[7]);
  } else if (mode == "swizzle") {
    int dt = (int)a[0];
    if (dt == 0) run_swizzle<QcF32>(in, outp, a[1], a[2], a[3], (int)a[4], (int)a[5], (int)a[6], (qc_u32)a[7], a[8]);
    if (dt == 1) run_swizzle<QcBF16>(in, outp, a[1], a[2], a[3], (int)a[4], (int)a[5], (int)a[6], (qc_u32)a[7], a[8]);
    if (dt == 2) run_swizzle<QcF16>(in, outp, a[1], a[2], a[3], (int)a[4], (int)a[5], (int)a[6], (qc_u32)a[7], a[8]);
  } else if (mode == "dequant") {
    int dt = (int)a[0];
    if (dt == 0) run_dequant<QcF32>(in, outp, a[1], a[2], (int)a[3], (int)a[4]);
    if (dt == 1) run_dequant<QcBF16>(in, outp, a[1], a[2], (int)a[3], (int)a[4]);
    if (dt == 2) run_dequant<QcF16>(in, outp, a[1], a[2], (int)a[3], (int)a[4]);
  } else if (mode == "reduce" || mode == "requant") {
    qc_u64 k = a[0], rows = a[1], n = a[2];
    int bits = (int)a[3], block = (int)a[4];
    qc_u64 rb = qc_packed_nbytes(n, bits, block), codes = qc_codes_nbytes(n, bits, block);
    const qc_u8* bufs = in.data();
    if (mode == "reduce") {
      std::vector<float> out(rows * n);
      for (qc_u64 r = 0; r < rows; ++r)
        for (qc_u64 e0 = 0; e0 < n; e0 += QC_GROUP) {
          float v[QC_GROUP];
          qc_reduce_load8(bufs, k, rows * rb, rb, codes, r, e0, n, bits, block, v);
          qc_store8<QcF32>(out.data() + r * n, e0, n, 0, v);
        }
      write_all(outp, out.data(), out.size() * 4);
    } else {
      int bits_o = (int)a[5], block_o = (int)a[6], stoch = (int)a[7];
      qc_u32 seed = (qc_u32)a[8];
      qc_u64 offset = a[9], rbo = qc_packed_nbytes(n, bits_o, block_o);
      std::vector<qc_u8> out(rows * rbo, 0xEE);
      for (qc_u64 r = 0; r < rows; ++r)
        quantize_row<QcF32>(
            [&](qc_u64 e0, float* v) { qc_reduce_load8(bufs, k, rows * rb, rb, codes, r, e0, n, bits, block, v); },
            n, bits_o, block_o, out.data() + r * rbo, stoch, seed, offset);
      write_all(outp, out.data(), out.size());
    }
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  return 0;
}
