"""Codec throughput on CPU: quantize+pack and unpack+dequantize of 64 MiB fp32 vs Tensor.copy_.

Run: python bench/codec_throughput.py [--mib 64] [--repeat 5]
Prints the median seconds and GB/s of each, and the ratio to copy_ measured in the same run.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qcoll.quant import reference


def median_time(fn, repeat):
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    a = ap.parse_args()
    n = a.mib * 2**20 // 4
    x = torch.randn(1, n)
    dst = torch.empty_like(x)
    t_copy = median_time(lambda: dst.copy_(x), a.repeat)
    nbytes = x.numel() * 4
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {a.mib} MiB fp32")
    print(f"{'op':<28} {'median s':>9} {'GB/s':>7} {'vs copy_':>8}")
    print(f"{'copy_':<28} {t_copy:>9.4f} {nbytes / t_copy / 1e9:>7.2f} {1.0:>8.2f}")
    for bits in a.bits:
        for block in (256, 128):
            q = reference.quantize_rows(x, bits, block)
            tq = median_time(lambda: reference.quantize_rows(x, bits, block), a.repeat)
            td = median_time(lambda: reference.dequantize_rows(q, n, bits, block, torch.float32), a.repeat)
            for name, t in ((f"quantize+pack {bits}b/{block}", tq), (f"unpack+dequantize {bits}b/{block}", td)):
                print(f"{name:<28} {t:>9.4f} {nbytes / t / 1e9:>7.2f} {t_copy / t:>8.2f}")


if __name__ == "__main__":
    main()
