"""Per-call cost of the CUDA codec path on a small tensor, layer by layer (needs a GPU).

Run: python bench/cuda_overhead.py [--numel 4096] [--calls 2000]
For each layer, from the bare kernel launch up to the public ``qcoll.quantize``,
prints the host microseconds per call (``calls`` calls queued back to back, one
synchronize at the end: what a training step pays per collective) next to
``Tensor.copy_`` of the same tensor, measured the same way in the same run.
(``qcoll.bindings`` is CUDA only: the ``--device cpu`` mode of earlier versions, which ran the
ops on the torch reference, is gone.)
"""
from __future__ import annotations

import argparse
import time

import torch

import qcoll
from qcoll.bindings import launch, ops
from qcoll.quant import rows


def per_call_us(fn, calls: int, sync) -> float:
    for _ in range(20):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args()
    n, bits, block = a.numel, 8, 256
    x = torch.randn(1, n, device="cuda")
    dst = torch.empty_like(x)
    out = ops.quantize_rows(x, bits, block)
    deq = torch.empty_like(x)
    packed = qcoll.quantize(x.reshape(-1), bits=bits, block_size=block)
    layers = [
        ("Tensor.copy_ (baseline)", lambda: dst.copy_(x)),
        ("launch.quantize_rows_into", lambda: launch.quantize_rows_into(x, out, bits, block, False, 0, 0)),
        ("ops implementation (quantize)", lambda: ops._quantize_rows_impl(x, bits, block, False, 0, 0)),
        ("ops custom op (quantize)", lambda: ops._quantize_rows_op(x, bits, block, False, 0, 0)),
        ("ops.quantize_rows (eager)", lambda: ops.quantize_rows(x, bits, block)),
        ("rows.quantize_rows (dispatch)", lambda: rows.quantize_rows(x, bits, block)),
        ("qcoll.quantize (public)", lambda: qcoll.quantize(x.reshape(-1), bits=bits, block_size=block)),
        ("launch.dequantize_rows_into", lambda: launch.dequantize_rows_into(out, deq, n, bits, block)),
        ("rows.dequantize_rows (dispatch)", lambda: rows.dequantize_rows(out, n, bits, block, torch.float32)),
        ("qcoll.dequantize (public, out=)", lambda: qcoll.dequantize(packed, out=deq.reshape(-1))),
    ]
    where = torch.cuda.get_device_name()
    sync = torch.cuda.synchronize
    print(f"torch {torch.__version__}, {where}, {n} fp32 elements, {bits}-bit/{block}")
    print(f"{'layer':<34} {'us/call':>8} {'vs copy_':>8}")
    base = None
    for name, fn in layers:
        us = per_call_us(fn, a.calls, sync)
        base = base or us
        print(f"{name:<34} {us:>8.1f} {us / base:>8.2f}")


if __name__ == "__main__":
    main()
