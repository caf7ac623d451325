"""Codec throughput: quantize+pack and unpack+dequantize of fp32 vs Tensor.copy_ of the same tensor.

Run: python bench/codec_throughput.py [--device cpu|cuda] [--mib 64] [--repeat 5] [--bits 8 4]
Prints the median seconds and GB/s (input fp32 bytes / time) of each, and the
ratio to copy_ measured in the same run. Dequantize is timed twice: returning a
fresh tensor (whose pages the OS must fault in and zero, which copy_ into an
existing tensor never pays) and into an existing ``out``, as the collectives use it. It times what
qcoll.quant.rows runs: on CPU qcoll.quant.cpu (the torch.compile'd path where it applies, else the
torch reference); on CUDA the kernels (CUDA events, after a warm-up that compiles them), plus the qgZ
kernels (swizzle+quantize, reduce+requantize of 4 inputs).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from qcoll.quant import rows


def _once(fn, device) -> float:
    if device == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(fn, baseline, repeat, device):
    """Median seconds of ``fn`` and of ``baseline``, run alternately (so that the machine's
    drift, large on a shared 2-core VM, hits both alike)."""
    fn()
    baseline()
    ts, tb = [], []
    for _ in range(repeat):
        ts.append(_once(fn, device))
        tb.append(_once(baseline, device))
    return statistics.median(ts), statistics.median(tb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    a = ap.parse_args()
    dev = a.device
    codec = rows
    n = a.mib * 2**20 // 4
    x = torch.randn(1, n, device=dev)
    dst = torch.empty_like(x)
    copy = lambda: dst.copy_(x)  # noqa: E731
    nbytes = x.numel() * 4
    where = torch.cuda.get_device_name() if dev == "cuda" else f"threads {torch.get_num_threads()}"
    print(f"torch {torch.__version__}, {dev} ({where}), {a.mib} MiB fp32")
    print(f"{'op':<34} {'median s':>9} {'GB/s':>7} {'copy_ s':>8} {'vs copy_':>8}")
    out = torch.empty_like(x)  # dequantize's out= (not copy_'s dst)

    def line(name, fn):
        t, t_copy = side_by_side(fn, copy, a.repeat, dev)
        print(f"{name:<34} {t:>9.5f} {nbytes / t / 1e9:>7.2f} {t_copy:>8.5f} {t_copy / t:>8.2f}")

    line("copy_", copy)
    for bits in a.bits:
        for block in (256, 128):
            q = codec.quantize_rows(x, bits, block)
            line(f"quantize+pack {bits}b/{block}", lambda: codec.quantize_rows(x, bits, block))
            line(f"unpack+dequantize {bits}b/{block}",
                 lambda: codec.dequantize_rows(q, n, bits, block, torch.float32))
            line(f"  the same into out= {bits}b/{block}", lambda: codec.dequantize_rows_into(q, n, bits, block, out))
            if dev != "cuda":
                continue
            line(f"stochastic quantize {bits}b/{block}", lambda: codec.quantize_rows(x, bits, block, True, 7, 0))
            xs = x.reshape(-1)
            line(f"swizzle+quantize 2x4 {bits}b/{block}", lambda: codec.swizzle_quantize(xs, 2, 4, bits, block))
            bufs = torch.stack([q] * 4)  # 4 inputs, each the size of the whole tensor
            line(f"reduce+requantize k=4 {bits}b/{block}",
                 lambda: codec.reduce_requantize(bufs, n, bits, block, bits, block))


if __name__ == "__main__":
    main()
