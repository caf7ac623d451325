"""Compiled CPU codec at a git revision vs the working tree, side by side with copy_ in one process.

Run: python bench/codec_compare.py [--rev main] [--bits 8 6 4 2] [--blocks 256 128] [--repeat 15]
     [--threads N] [--mib 64]
Loads ``qcoll/quant/compiled.py`` as it was at ``--rev`` next to the current one (both use the
current reference, format and bitpack) and times quantize_rows and dequantize_rows_into (fp32
``out=``) of each, alternated with ``copy_`` of the same tensor, so that the drift of a shared
machine hits all alike. Prints each one's ratio to copy_ (copy_ s / op s), median and best.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from qcoll.quant import compiled, reference


def _load_rev(rev: str):
    root = pathlib.Path(__file__).resolve().parent.parent
    src = subprocess.run(["git", "-C", str(root), "show", f"{rev}:qcoll/quant/compiled.py"],
                         check=True, capture_output=True, text=True).stdout
    path = pathlib.Path(tempfile.mkdtemp()) / "compiled_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("qcoll.quant._compiled_rev", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="main")
    ap.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4, 2])
    ap.add_argument("--blocks", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--mib", type=int, default=64)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    mods = {a.rev: _load_rev(a.rev), "now": compiled}
    n = a.mib * 2**20 // 4
    x = torch.randn(1, n)
    dst, out = torch.empty_like(x), torch.empty_like(x)
    print(f"torch {torch.__version__}, cpu (threads {torch.get_num_threads()}), {a.mib} MiB fp32; "
          f"ratio to copy_ median/best")

    def race(fns):
        for f in fns.values():
            f()
        ts = {k: [] for k in fns}
        for _ in range(a.repeat):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t0)
        return ({k: statistics.median(v) for k, v in ts.items()}, {k: min(v) for k, v in ts.items()})

    for bits in a.bits:
        for block in a.blocks:
            q = reference.quantize_rows(x, bits, block)
            for op in ("quantize", "dequantize"):
                fns = {"copy_": lambda: dst.copy_(x)}
                for k, m in mods.items():
                    if op == "quantize":
                        if not torch.equal(m.quantize_rows(x, bits, block), q):
                            raise SystemExit(f"{k}: quantize {bits}b/{block} differs from the reference")
                        fns[k] = lambda m=m: m.quantize_rows(x, bits, block)
                    else:
                        fns[k] = lambda m=m: m.dequantize_rows_into(q, n, bits, block, out)
                med, best = race(fns)
                cols = "  ".join(f"{k} {med['copy_'] / med[k]:.2f}/{best['copy_'] / best[k]:.2f}" for k in mods)
                print(f"{op:<10} {bits}b/{block}: {cols}   (copy_ {med['copy_'] * 1e3:.2f}/{best['copy_'] * 1e3:.2f} ms)",
                      flush=True)


if __name__ == "__main__":
    main()
