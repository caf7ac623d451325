"""Codec throughput: quantize+pack and unpack+dequantize of fp32 vs Tensor.copy_ of the same tensor.

Run: python bench/codec_throughput.py [--device cpu|cuda] [--mib 64] [--repeat 5] [--bits 8 4]
Prints the median seconds and GB/s (input fp32 bytes / time) of each, and the
ratio to copy_ measured in the same run. On CPU it times the torch reference
(its torch.compile'd path included); on CUDA the kernels that qcoll.quant.rows
dispatches to (CUDA events, after a warm-up that compiles them), plus the qgZ
kernels (swizzle+quantize, reduce+requantize of 4 inputs).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qcoll.quant import reference, rows


def median_time(fn, repeat, device):
    fn()
    ts = []
    for _ in range(repeat):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            ts.append(start.elapsed_time(stop) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    a = ap.parse_args()
    dev = a.device
    codec = rows if dev == "cuda" else reference
    n = a.mib * 2**20 // 4
    x = torch.randn(1, n, device=dev)
    dst = torch.empty_like(x)
    t_copy = median_time(lambda: dst.copy_(x), a.repeat, dev)
    nbytes = x.numel() * 4
    where = torch.cuda.get_device_name() if dev == "cuda" else f"threads {torch.get_num_threads()}"
    print(f"torch {torch.__version__}, {dev} ({where}), {a.mib} MiB fp32")
    print(f"{'op':<34} {'median s':>9} {'GB/s':>7} {'vs copy_':>8}")

    def line(name, t):
        print(f"{name:<34} {t:>9.5f} {nbytes / t / 1e9:>7.2f} {t_copy / t:>8.2f}")

    line("copy_", t_copy)
    for bits in a.bits:
        for block in (256, 128):
            q = codec.quantize_rows(x, bits, block)
            line(f"quantize+pack {bits}b/{block}",
                 median_time(lambda: codec.quantize_rows(x, bits, block), a.repeat, dev))
            line(f"unpack+dequantize {bits}b/{block}",
                 median_time(lambda: codec.dequantize_rows(q, n, bits, block, torch.float32), a.repeat, dev))
            if dev != "cuda":
                continue
            line(f"stochastic quantize {bits}b/{block}",
                 median_time(lambda: codec.quantize_rows(x, bits, block, True, 7, 0), a.repeat, dev))
            xs = x.reshape(-1)
            line(f"swizzle+quantize 2x4 {bits}b/{block}",
                 median_time(lambda: codec.swizzle_quantize(xs, 2, 4, bits, block), a.repeat, dev))
            bufs = torch.stack([q] * 4)  # 4 inputs, each the size of the whole tensor
            line(f"reduce+requantize k=4 {bits}b/{block}",
                 median_time(lambda: codec.reduce_requantize(bufs, n, bits, block, bits, block), a.repeat, dev))


if __name__ == "__main__":
    main()
