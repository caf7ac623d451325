"""torch.compile'd CPU fast path for large round-to-nearest quantize and for dequantize.

Beside the reference, not inside it: :mod:`qcoll.quant.cpu` calls it when :func:`enabled`
and falls back to :mod:`qcoll.quant.reference` when it returns None/False. The fused loops
run the same fp32 operations as the reference (the scaling loop *is* the reference's
:func:`~qcoll.quant.reference.scale_into`, compiled; no additions are involved in
round-to-nearest, so no multiply-add contraction can change a bit) and are checked against
it in tests. Used for CPU tensors of at least ``MIN_NUMEL`` elements; ``QCOLL_COMPILE=0``
turns it off, and any compile failure falls back to the eager reference for the rest of
the process.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from . import format as fmt
from .bitpack import pack_codes, unpack_codes
from .reference import pad_blocks, row_sections, scale_into, scale_rows_into

MIN_NUMEL = 1 << 20
_broken = False


def enabled(device: torch.device, numel: int) -> bool:
    """Whether an operation on ``numel`` elements on ``device`` takes the compiled path."""
    if _broken or device.type != "cpu" or numel < MIN_NUMEL:
        return False
    return os.environ.get("QCOLL_COMPILE", "1") not in ("0", "false", "False")


def _quantize_blocks(xb: torch.Tensor, qmaxv: float, bits: int):
    absmax = xb.abs().amax(dim=-1, keepdim=True)
    qm = torch.full_like(absmax, qmaxv)
    scale = absmax / qm
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), qm / absmax)
    t = torch.round(xb * inv).clamp(-qmaxv, qmaxv)
    finite = torch.isfinite(absmax)
    q = torch.where(finite, t, torch.zeros_like(t)).to(torch.int8)
    bits_ = torch.where(finite, scale.view(torch.int32), torch.full_like(scale.view(torch.int32), fmt.NAN_SCALE_BITS))
    tiny = (torch.isinf(inv) & finite).any()
    codes = q.reshape(xb.shape[0], -1)
    if bits == 8:   # packing is a view
        codes = codes.view(torch.uint8)
    return codes, bits_.view(torch.uint8).reshape(xb.shape[0], -1), tiny


# Sub-byte packing and unpacking are compiled as graphs of their own: fused with
# the quantization or scaling loop, inductor's CPU code for the byte shuffles was
# 4-8x slower than the two loops run one after the other (64 MiB fp32, 2 cores:
# 4-bit quantize+pack 0.052 s fused, 0.007 s split). The scaling loop sees the
# block size as a static dimension (``mark_static``): with a symbolic one inductor
# computed every element's block with a division and ran 20x slower.
@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"quantize": _quantize_blocks, "pack": pack_codes, "unpack": unpack_codes, "scale": scale_into}[name]
    return torch.compile(fn, dynamic=True)


@functools.lru_cache(maxsize=1)
def _raise_recompile_limit() -> None:
    """Once per process: a per-function recompile limit above these graphs' variants (bits x
    block sizes x output dtypes), so that a process using many never falls back to eager.
    (Process-wide, as dynamo has no per-function limit; it is only ever raised, never lowered.)"""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(64, getattr(config, name)))


def _call(name, *args):
    global _broken
    try:
        _raise_recompile_limit()
        return _compiled(name)(*args)
    except Exception as e:  # a compiler problem must never break the codec
        _broken = True
        warnings.warn(f"qcoll: torch.compile fast path disabled ({type(e).__name__}: {e}); using eager reference")
        return None


def quantize_rows(x: torch.Tensor, bits: int, block_size: int) -> torch.Tensor | None:
    """Round-to-nearest: float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n)]``, or None where
    the reference must run (a compiler failure, or blocks in the subnormal range)."""
    fast = quantize_blocks(pad_blocks(x.to(torch.float32), block_size), bits)
    if fast is None or bool(fast[2]):
        return None
    return torch.cat(fast[:2], dim=1)


def quantize_blocks(xb: torch.Tensor, bits: int):
    """Padded fp32 ``[rows, nb, block]`` -> (packed codes, scale bytes, any_tiny) or None on failure."""
    out = _call("quantize", xb, float(fmt.qmax(bits)), bits)
    if out is None or bits == 8:
        return out
    codes = _call("pack", out[0], bits)
    return None if codes is None else (codes, *out[1:])


def _scale_compiled(q3: torch.Tensor, scales: torch.Tensor, out3: torch.Tensor):
    for t in (q3, out3):
        torch._dynamo.mark_static(t, 2)  # the block size: see above
    return _call("scale", q3, scales, out3)


def dequantize_rows_into(buf: torch.Tensor, n: int, bits: int, block_size: int, out: torch.Tensor) -> bool:
    """uint8 ``[..., packed_nbytes(n)]`` -> ``out`` ``[..., n]``, contiguous and not sharing
    ``buf``'s storage (see :func:`qcoll.quant.reference.direct_out`). False on a compiler failure."""
    codes, scales = row_sections(buf, n, bits, block_size)
    return dequantize_into(codes, scales, bits, block_size, out.view(codes.shape[0], n))


def dequantize_into(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
                    out: torch.Tensor) -> bool:
    """Packed codes ``[rows, k]``, fp32 scales ``[rows, nb]`` -> ``out`` ``[rows, n]``
    (``n > (nb-1)*block_size``, the last dimension contiguous). False on a compiler failure."""
    q = codes.view(torch.int8) if bits == 8 else _call("unpack", codes, bits)
    return q is not None and scale_rows_into(q, scales, block_size, out, _scale_compiled)
