"""Per-call cost of the collectives' frame headers (docs/FORMAT.md "Frames") next to the codec work.

Run: python bench/framing_overhead.py [--world 4] [--numel 64 4096 65536] [--bits 8] [--block 256]

For one rank of a ``--world``-rank qwZ all-gather of ``numel`` elements per shard it
times, single-process and on CPU (one thread), what framing adds to a call: building
the header tensor (cached), putting it in front of the packed shard (one copy of
the shard's bytes), allocating the receive buffer with zeroed header slots, and
checking the ``world`` received headers; next to them the codec work the call
does anyway (quantize the shard, dequantize ``world`` received rows, straight from
the framed buffer). Each figure is the best of 7 repeats of a mean over 200 calls.
"""
from __future__ import annotations

import argparse
import timeit

import torch

from qcoll.comm import framing
from qcoll.quant import rows


def per_call_us(fn, number: int = 200, repeat: int = 7) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def measure(numel: int, bits: int, block: int, world: int) -> dict:
    """Microseconds per call of each framing step and of the codec steps around it."""
    cpu = torch.device("cpu")
    x = torch.randn(1, numel)
    header = framing.Header(bits, block, numel)
    packed = rows.quantize_rows(x, bits, block)
    recv = framing.frame(packed, header).repeat(world, 1)
    out = torch.empty(world, numel)
    steps = {
        "header": lambda: framing.header_tensor(framing.Header(bits, block, numel), cpu),
        "frame": lambda: framing.frame(packed, header),
        "receive_buffer": lambda: framing.receive_buffer(world, recv.shape[1], cpu),
        "check": lambda: framing.unframe(recv, header, None),
        "quantize": lambda: rows.quantize_rows(x, bits, block),
        "dequantize": lambda: rows.dequantize_rows_into(recv[:, framing.HEADER_BYTES:], numel, bits, block, out),
    }
    return {name: per_call_us(fn) for name, fn in steps.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--numel", type=int, nargs="+", default=[64, 4096, 65536])
    p.add_argument("--bits", type=int, default=8)
    p.add_argument("--block", type=int, default=256)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{'numel':>8} {'header':>8} {'frame':>8} {'recvbuf':>8} {'check':>8} {'framing':>8} "
          f"{'quantize':>9} {'dequant':>9} {'framing/codec':>13}   (us per call)")
    for n in args.numel:
        t = measure(n, args.bits, args.block, args.world)
        framing_us = t["header"] + t["frame"] + t["receive_buffer"] + t["check"]
        codec_us = t["quantize"] + t["dequantize"]
        print(f"{n:>8} {t['header']:>8.1f} {t['frame']:>8.1f} {t['receive_buffer']:>8.1f} {t['check']:>8.1f} "
              f"{framing_us:>8.1f} {t['quantize']:>9.1f} {t['dequantize']:>9.1f} {framing_us / codec_us:>13.3f}")


if __name__ == "__main__":
    main()
