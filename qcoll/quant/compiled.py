"""torch.compile'd CPU fast path for large round-to-nearest quantize and for dequantize.

Beside the reference, not inside it: :mod:`qcoll.quant.cpu` calls it when :func:`enabled`
and falls back to :mod:`qcoll.quant.reference` when it returns None/False. The fused loops
run the same fp32 operations as the reference (the scaling loop *is* the reference's
:func:`~qcoll.quant.reference.scale_into`, compiled; no additions are involved in
round-to-nearest, so no multiply-add contraction can change a bit) and are checked against
it in tests (the packed bytes exactly; decoded values bit for bit, NaNs as NaNs). Quantize
writes straight into the packed buffer it returns. Used for CPU tensors of at least
``MIN_NUMEL`` elements; ``QCOLL_COMPILE=0`` turns it off, and any compile failure falls back
to the eager reference for the rest of the process.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from . import format as fmt
from .bitpack import pack_codes, unpack_codes
from . import reference
from .reference import row_sections, scale_into, scale_rows_into

MIN_NUMEL = 1 << 20
_broken = False


def enabled(device: torch.device, numel: int) -> bool:
    """Whether an operation on ``numel`` elements on ``device`` takes the compiled path."""
    if _broken or device.type != "cpu" or numel < MIN_NUMEL:
        return False
    return os.environ.get("QCOLL_COMPILE", "1") not in ("0", "false", "False")


def _block_scales(xb: torch.Tensor, qmaxv: float):
    """Per block of fp32 ``[rows, nb, B]``: 1/scale, finiteness, the scale's wire bits (int32,
    NaN bits for a non-finite block) and whether it is finite with an infinite 1/scale (the
    subnormal range, which only the reference handles). The reference's fp32 operations."""
    absmax = xb.abs().amax(dim=-1, keepdim=True)
    qm = torch.full_like(absmax, qmaxv)
    scale = absmax / qm
    inv = torch.where(absmax == 0, torch.zeros_like(absmax), qm / absmax)
    finite = torch.isfinite(absmax)
    bits_ = torch.where(finite, scale.view(torch.int32), torch.full_like(scale.view(torch.int32), fmt.NAN_SCALE_BITS))
    tiny = torch.isinf(inv) & finite  # per block (an any() here was a second parallel loop)
    return inv, finite, bits_, tiny


def _round(v: torch.Tensor, inv: torch.Tensor, finite: torch.Tensor, qmaxv: float) -> torch.Tensor:
    """fp32 values -> int32 codes: the reference's ``clamp(rint(v * inv), -qmax, qmax)``, 0 in
    non-finite blocks, without the clamp, which never changes a code here: in a finite block
    with a finite ``inv`` (the others are the reference's), ``|v| <= absmax`` and ``inv`` is
    ``qmax / absmax`` correctly rounded, so ``|v * inv| <= qmax * (1 + 2**-24)**2`` and rint
    gives at most ``qmax`` (inductor's NaN-propagating clamp cost 8 instructions per 16 values)."""
    t = torch.round(v * inv)
    return torch.where(finite, t, torch.zeros_like(t)).to(torch.int32)


def _quantize_into(xb: torch.Tensor, qmaxv: float, bits: int, codes_out: torch.Tensor):
    """fp32 ``[rows, nb, B]`` -> packed 8-, 4- or 2-bit codes written into ``codes_out`` (uint8
    ``[rows, nb, B*bits/8]``, a view of the packed buffer); returns the scale bits ``[rows, nb]``
    and the blocks' tiny flags. One pass per block: its absmax, then its codes from the same
    (cached) block, stored straight into the caller's buffer. For 4 and 2 bits the block is
    read as int64 words, each two fp32 values (little-endian: element 2k in the low half): a
    4-bit byte is one word, so the loop vectorizes; a 2-bit byte is two words (one strided load
    each; used for blocks of 64 and 128, see the notes above :func:`_compiled`)."""
    inv, finite, bits_, tiny = _block_scales(xb, qmaxv)
    if bits == 8:
        packed = _round(xb, inv, finite, qmaxv) & 0xFF
    else:
        w = xb.view(torch.int64)
        lo = (w & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        hi = (w >> 32).to(torch.int32).view(torch.float32)
        if bits == 4:
            packed = (_round(lo, inv, finite, qmaxv) & 0xF) | ((_round(hi, inv, finite, qmaxv) & 0xF) << 4)
        else:
            p = (_round(lo, inv, finite, qmaxv) & 0x3) | ((_round(hi, inv, finite, qmaxv) & 0x3) << 2)
            p = p.view(p.shape[0], p.shape[1], -1, 2)
            packed = p[..., 0] | (p[..., 1] << 4)
    codes_out.copy_(packed.to(torch.uint8))
    return bits_.squeeze(-1), tiny


def _quantize_blocks(xb: torch.Tensor, qmaxv: float, bits: int):
    """fp32 ``[rows, nb, B]`` -> int8 codes ``[rows, nb*B]`` (6 bits, and 2 bits in blocks other
    than 64 and 128, packed by the "pack_into" graph), scale bits ``[rows, nb]``, tiny flags."""
    inv, finite, bits_, tiny = _block_scales(xb, qmaxv)
    q = _round(xb, inv, finite, qmaxv).to(torch.int8)
    return q.reshape(xb.shape[0], -1), bits_.squeeze(-1), tiny


def _pack_into(q: torch.Tensor, bits: int, codes_out: torch.Tensor) -> bool:
    """6 bits (2 bits outside blocks of 64/128): int8 codes ``[rows, m]`` packed straight into ``codes_out``."""
    codes_out.copy_(pack_codes(q, bits))
    return True


def _dequantize_pairs_into(codes3: torch.Tensor, scales: torch.Tensor, out_words: torch.Tensor) -> bool:
    """4-bit codes uint8 ``[rows, nb, B/2]`` x fp32 scales ``[rows, nb]`` -> ``out_words``, the
    fp32 output viewed as int64 words of two values: byte k's two codes become word k, the low
    nibble in the low half. Each output word depends on one byte, so the loop vectorizes; the
    values are the reference's (``q * scale`` saturated to the fp32 range)."""
    b = codes3.to(torch.int32)
    s = scales.unsqueeze(-1)
    lo = ((((b & 0xF) ^ 8) - 8).to(torch.float32) * s).clamp(-fmt.FLT_MAX, fmt.FLT_MAX)
    hi = ((((b >> 4) ^ 8) - 8).to(torch.float32) * s).clamp(-fmt.FLT_MAX, fmt.FLT_MAX)
    word = (lo.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (hi.view(torch.int32).to(torch.int64) << 32)
    out_words.copy_(word)
    return True


# How the graphs are shaped (64 MiB fp32, 2 cores, each measured against copy_ in one run;
# bench/RESULTS.md has the history):
# - 8, 4 and 2 bits quantize in one graph that writes its codes straight into the packed buffer (a
#   view passed in and filled with copy_, which inductor turns into stores to that memory): one
#   loop per block computes the absmax and then the codes from the block still in cache. Graphs
#   that returned the codes for a torch.cat (or wrote both buffer sections of one input) were
#   2-3x slower: the extra copy, or a loop over the whole buffer with an index test per byte.
# - Packing and unpacking compute each output element from one input word (two fp32 values as
#   an int64 for a 4-bit byte; int16/int32 words of int8 codes in bitpack), never gathering at
#   strides of 2-4 elements, which inductor turned into scalar loops (4-8x slower).
# - 6 bits (and 2 bits outside blocks of 64/128) quantize to int8 codes in one graph and pack
#   them in another. A one-pass 6-bit graph (int64 pairs -> three int32 words per 16 codes) was 1.5x
#   faster at blocks of 256-512 but 2.5-10x slower at 32-128 (in cache, one thread). One-pass
#   2 bits: 2x faster in cache at blocks of 64-1024 but 2.5x slower at 32; at 64 MiB on 2
#   threads 0.79x of copy_ against 0.64x at block 128, but no gain at 256 and a loss at 512
#   (0.62x against 0.70x), so only blocks of 64 and 128 take it.
# - The block size is a static dimension (``mark_static``): with a symbolic one inductor
#   computed every element's block with a division and ran 20x slower.
@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    fn = {"quantize_into": _quantize_into, "quantize": _quantize_blocks, "pack_into": _pack_into,
          "unpack": unpack_codes, "scale": scale_into, "dequantize_pairs": _dequantize_pairs_into}[name]
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


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` viewed as ``dtype`` words of two elements, or None where its offset or strides forbid it."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


def quantize_rows(x: torch.Tensor, bits: int, block_size: int, buf: torch.Tensor | None = None) -> torch.Tensor | None:
    """Round-to-nearest: float ``[rows, n]`` -> uint8 ``[rows, packed_nbytes(n)]`` (``buf`` when
    given: a uint8 tensor of that shape whose last dimension is contiguous), or None where the
    reference must run (a compiler failure, or blocks in the subnormal range).

    The whole blocks are read in place (no padded copy) and their codes and scales written
    straight into the packed buffer; a partial last block goes through the reference."""
    x = x.to(torch.float32)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, n = x.shape
    full, bb = n // block_size, fmt.block_code_bytes(bits, block_size)
    if buf is None:
        buf = torch.empty(rows, fmt.packed_nbytes(n, bits, block_size), dtype=torch.uint8, device=x.device)
    cb = fmt.codes_nbytes(n, bits, block_size)
    codes, scale_bytes = buf[:, :cb], buf[:, cb:]
    if full:
        xb = x[:, : full * block_size].view(rows, full, block_size)
        if bits in (4, 2) and _words(xb, torch.int64) is None:  # an odd row length or offset: a copy
            xb = xb.contiguous()
        sbits = quantize_full_blocks(xb, bits, codes[:, : full * bb])
        if sbits is None:
            return None
        scale_bytes[:, : 4 * full].copy_(sbits.view(torch.uint8))
    if n > full * block_size:
        tail = reference.quantize_rows(x[:, full * block_size:], bits, block_size)  # [rows, bb + 4]
        codes[:, full * bb:].copy_(tail[:, :bb])
        scale_bytes[:, 4 * full:].copy_(tail[:, bb:])
    return buf


def quantize_full_blocks(xb: torch.Tensor, bits: int, codes_out: torch.Tensor) -> torch.Tensor | None:
    """fp32 ``[rows, nb, B]`` -> codes written into ``codes_out`` (uint8 ``[rows, nb*B*bits/8]``,
    a view of the packed buffer); returns the scale bits (int32 ``[rows, nb]``), or None where the
    reference must run (a compiler failure, or blocks in the subnormal range)."""
    rows, nb, block = xb.shape
    qmaxv = float(fmt.qmax(bits))
    torch._dynamo.mark_static(xb, 2)  # the block size: see above
    if bits in (8, 4) or (bits == 2 and block in (64, 128)):  # 2 bits: see the notes above _compiled
        out3 = codes_out.view(rows, nb, block * bits // 8)
        torch._dynamo.mark_static(out3, 2)
        out = _call("quantize_into", xb, qmaxv, bits, out3)
        return None if out is None or bool(out[1].any()) else out[0]
    out = _call("quantize", xb, qmaxv, bits)
    if out is None or bool(out[2].any()) or _call("pack_into", out[0], bits, codes_out) is None:
        return None
    return out[1]


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
    if bits == 4 and _dequantize_pairs(codes, scales, block_size, out):
        return True
    q = codes.view(torch.int8) if bits == 8 else _call("unpack", codes, bits)
    return q is not None and scale_rows_into(q, scales, block_size, out, _scale_compiled)


def _dequantize_pairs(codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor) -> bool:
    """4 bits into fp32: the whole blocks decoded byte -> word of two values straight into ``out``
    (see :func:`_dequantize_pairs_into`), a partial last block through the reference. False
    (nothing written) for other dtypes (the same graph into bf16 words ran at half the speed of
    unpack + scale), where ``out`` cannot be viewed as words, or on a compiler failure."""
    rows, n = out.shape
    full = n // block_size
    if out.dtype != torch.float32 or not full:
        return False
    words = _words(out[:, : full * block_size].view(rows, full, block_size), torch.int64)
    if words is None:
        return False
    codes3 = codes[:, : full * block_size // 2].view(rows, full, block_size // 2)
    for t in (codes3, words):
        torch._dynamo.mark_static(t, 2)  # the block size: see above
    if _call("dequantize_pairs", codes3, scales[:, :full], words) is None:
        return False
    if n > full * block_size:
        q = unpack_codes(codes[:, full * block_size // 2:], 4)
        scale_into(q[:, : n - full * block_size].unsqueeze(1), scales[:, full:], out[:, full * block_size:].unsqueeze(1))
    return True
