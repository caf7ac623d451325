"""Frames: the 16-byte header a quantized collective puts in front of each buffer it sends.

The codec's packed rows carry no header (their layout follows from numel, bits
and block size alone). The collectives frame what they send to one peer with
:class:`Header` (layout in docs/FORMAT.md, "Frames"), and every receiver compares
the headers it got with the one its own arguments give *before* decoding, so a
rank that passed a different size, ``bits`` or ``block_size`` makes the others
raise :class:`~qcoll.comm.errors.RankMismatchError` instead of decoding garbage. The
reductions' frames also say whether the sender averages (``op="avg"``), so ranks that
disagree on the reduction raise too instead of summing what others average.
The comparison is one 16-byte compare per received frame; the frames are
counted in the byte accounting.
"""
from __future__ import annotations

import contextlib
import functools
import struct
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..quant import format as fmt
from ..quant import outliers
from ..quant.rng import mix32_int as mix32
from .errors import RankMismatchError

HEADER_BYTES = 16
MAGIC = b"qZ"
VERSION = 1
FLAG_POISONED = 0x01
FLAG_ROTATED = 0x02
OUTLIERS_SHIFT = 2     # flags bits 2-5: the outlier reserve per block (0-8)
OUTLIERS_MASK = 0x0F
FLAG_AVERAGE = 0x40    # a reduction's op="avg" (sum: clear; the all-gathers: clear)
FLAG_ERROR_FEEDBACK = 0x80   # the sender added its error-feedback residual before quantizing
MAX_NUMEL = 2**48 - 1
_PREFIX = struct.Struct("<2sBBBB6s")   # magic, version, flags, bits, log2(block_size), numel (u48)
_CHECK = struct.Struct("<I")

_enabled = True


def check_value(prefix: bytes) -> int:
    """The header's check value over its first 12 bytes (three little-endian u32 words)."""
    w0, w1, w2 = struct.unpack("<3I", prefix)
    return mix32(mix32(mix32(w0) ^ w1) ^ w2)


@dataclass(frozen=True)
class Header:
    """What one frame says about the packed rows behind it: ``bits``, ``block_size``,
    ``numel`` (elements per row), whether the sender marked it poisoned (it had
    received mismatching data earlier in the same collective; the payload is void) and
    whether the values are Hadamard-rotated (qgZ's ``hadamard=True``), each block's
    outlier reserve (docs/FORMAT.md "Outlier reserve"; 0: plain rows), whether a
    reduction averages (``op="avg"``; False for ``"sum"`` and for the all-gathers), and whether
    the sender quantized with error feedback (:class:`qcoll.comm.ErrorFeedback`)."""

    bits: int
    block_size: int
    numel: int
    poisoned: bool = False
    rotated: bool = False
    outliers: int = 0
    average: bool = False
    error_feedback: bool = False

    def to_bytes(self) -> bytes:
        if not 0 <= self.numel <= MAX_NUMEL:
            raise ValueError(f"numel must be in [0, 2**48) to be framed, got {self.numel}")
        log2 = self.block_size.bit_length() - 1
        flags = ((FLAG_POISONED if self.poisoned else 0) | (FLAG_ROTATED if self.rotated else 0)
                 | self.outliers << OUTLIERS_SHIFT | (FLAG_AVERAGE if self.average else 0)
                 | (FLAG_ERROR_FEEDBACK if self.error_feedback else 0))
        prefix = _PREFIX.pack(MAGIC, VERSION, flags, self.bits, log2,
                              self.numel.to_bytes(6, "little"))
        return prefix + _CHECK.pack(check_value(prefix))

    @classmethod
    def from_bytes(cls, raw: bytes) -> "Header":
        """Parse 16 bytes; ValueError saying what is wrong when they are not a valid header."""
        if len(raw) != HEADER_BYTES:
            raise ValueError(f"a header is {HEADER_BYTES} bytes, got {len(raw)}")
        magic, version, flags, bits, log2, numel = _PREFIX.unpack(raw[:12])
        if magic != MAGIC:
            raise ValueError(f"magic {magic!r} is not {MAGIC!r}")
        if _CHECK.unpack(raw[12:])[0] != check_value(raw[:12]):
            raise ValueError("check value does not match the header's fields")
        if version != VERSION:
            raise ValueError(f"version {version}, this qcoll reads version {VERSION}")
        reserve = flags >> OUTLIERS_SHIFT & OUTLIERS_MASK
        if (bits not in fmt.VALID_BITS or not fmt.MIN_BLOCK <= 1 << log2 <= fmt.MAX_BLOCK or flags >> 8
                or reserve > outliers.MAX_OUTLIERS):
            raise ValueError(f"fields out of range (flags={flags}, bits={bits}, log2(block_size)={log2})")
        return cls(bits, 1 << log2, int.from_bytes(numel, "little"), bool(flags & FLAG_POISONED),
                   bool(flags & FLAG_ROTATED), reserve, bool(flags & FLAG_AVERAGE),
                   bool(flags & FLAG_ERROR_FEEDBACK))

    def poison(self) -> "Header":
        return replace(self, poisoned=True)

    def payload_nbytes(self, rows: int = 1) -> int:
        """Bytes of ``rows`` packed rows behind this header."""
        return rows * outliers.packed_nbytes(self.numel, self.bits, self.block_size, self.outliers)

    def describe(self) -> str:
        extra = ((", hadamard" if self.rotated else "") + (f", outliers={self.outliers}" if self.outliers else "")
                 + (", op=avg" if self.average else "") + (", error_feedback" if self.error_feedback else ""))
        return f"bits={self.bits}, block_size={self.block_size}, numel={self.numel}{extra}"


@dataclass(frozen=True)
class Receipt:
    """Who sent what, for error messages only (built lazily, on a mismatch).

    ``op``: the collective (and hop); ``rank``: this global rank; ``sender(i)``:
    the global rank that sent received frame ``i``; ``origin(i)``: extra words on
    frame ``i`` (hpZ: whose shard it is) or None; ``rows``: packed rows per frame.
    """

    op: str
    rank: int
    sender: Callable[[int], int]
    origin: Callable[[int], str] | None = None
    rows: int = 1


# ---------------------------------------------------------------- switch (benchmarks only)

def header_bytes() -> int:
    """Bytes of the header in front of each frame (0 while framing is disabled)."""
    return HEADER_BYTES if _enabled else 0


@contextlib.contextmanager
def disabled():
    """Send unframed buffers and check nothing on receipt (``qcoll-bench`` measures the
    header's cost with it). Every rank must use it around the same calls, and an hpZ
    secondary shard must be filled and gathered under the same setting."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


# ---------------------------------------------------------------- sending

@functools.lru_cache(maxsize=1024)
def header_tensor(header: Header, device: torch.device) -> torch.Tensor:
    """The header's bytes as a uint8 tensor on ``device`` (cached; never written to)."""
    return torch.frombuffer(bytearray(header.to_bytes()), dtype=torch.uint8).to(device)


def frame(payload: torch.Tensor, header: Header) -> torch.Tensor:
    """uint8 ``[dests, m]`` -> ``[dests, HEADER_BYTES + m]``: ``header`` in front of every
    row (one row per destination). Returns ``payload`` itself while framing is disabled."""
    if not _enabled:
        return payload
    head = header_tensor(header, payload.device)
    return torch.cat((head.expand(payload.shape[0], HEADER_BYTES), payload), dim=1)


def receive_buffer(frames: int, nbytes: int, device) -> torch.Tensor:
    """uint8 ``[frames, nbytes]`` to receive into, with the header slots zeroed (never a valid
    header: a slot the transport left unwritten cannot pass as a stale one)."""
    buf = torch.empty(frames, nbytes, dtype=torch.uint8, device=device)
    if _enabled and nbytes >= HEADER_BYTES:
        buf[:, :HEADER_BYTES].zero_()
    return buf


# ---------------------------------------------------------------- receiving

def unframe(received: torch.Tensor, expected: Header, receipt: Callable[[], Receipt]) -> torch.Tensor:
    """Check every frame of ``received`` ``[k, HEADER_BYTES + m]`` against ``expected``; returns
    the payloads ``[k, m]`` (a view). Raises RankMismatchError naming the first sender whose
    header differs; ``receipt()`` is called only then."""
    if not _enabled:
        return received
    heads = received[:, :HEADER_BYTES]
    if not torch.equal(heads, header_tensor(expected, received.device).expand_as(heads)):
        raise _mismatch(heads, expected, receipt())
    return received[:, HEADER_BYTES:]


def check_unframed(received: torch.Tensor, receipt: Callable[[], Receipt]) -> None:
    """The unquantized collectives' check: no row of ``received`` (uint8 ``[k, nbytes]``, one
    row per sender) starts with a valid frame header, i.e. no peer called the quantized
    collective. Only on CPU (reading a GPU buffer back would synchronize the stream)."""
    if not _enabled or received.device.type != "cpu" or received.shape[-1] < HEADER_BYTES:
        return
    heads = received[:, :HEADER_BYTES]   # (no .numpy(): it would pin the caller's storage to its size)
    candidates = ((heads[:, 0] == MAGIC[0]) & (heads[:, 1] == MAGIC[1])).nonzero().flatten().tolist()
    for i in candidates:
        try:
            got = Header.from_bytes(bytes(heads[i].tolist()))
        except ValueError:
            continue  # plain data that happens to start like a header
        r = receipt()
        peer = r.sender(i)
        raise RankMismatchError(
            f"qcoll {r.op}: rank {r.rank} called the unquantized collective (bits=None) but received from "
            f"rank {peer} a quantized frame ({got.describe()}){_origin(r, i)}. {_ADVICE}",
            r.op, r.rank, peer, None, got)


_ADVICE = ("Every rank of the group must pass the same sizes, bits, block_size and op; QCOLL_DEBUG=1 compares "
           "all ranks' arguments before communicating.")


def _origin(r: Receipt, i: int) -> str:
    return f" ({r.origin(i)})" if r.origin is not None else ""


def _op(h: Header) -> str:
    return "avg" if h.average else "sum"


def _mismatch(heads: torch.Tensor, expected: Header, r: Receipt) -> RankMismatchError:
    """The error for the first frame of ``heads`` that differs from ``expected``."""
    raw = [bytes(row) for row in heads.tolist()]
    want = expected.to_bytes()
    bad = [i for i, row in enumerate(raw) if row != want]
    i = bad[0]
    peer = r.sender(i)
    more = f" ({len(bad)} of the {len(raw)} frames received disagree)" if len(bad) > 1 else ""
    where = f"qcoll {r.op}: rank {r.rank} received from rank {peer}{_origin(r, i)}"
    try:
        got = Header.from_bytes(raw[i])
    except ValueError as why:
        return RankMismatchError(
            f"{where} a buffer that does not start with a valid qcoll frame header ({why}; bytes "
            f"{raw[i].hex(' ')}){more}. Rank {peer} may have called the unquantized collective "
            f"(bits=None) or passed a size that made the transport misplace the data. {_ADVICE}",
            r.op, r.rank, peer, expected, None)
    if got.poisoned:
        return RankMismatchError(
            f"{where} a frame marked poisoned: rank {peer} had received mismatching data earlier in this "
            f"collective (its own error names the rank that disagreed){more}. Nothing was decoded. {_ADVICE}",
            r.op, r.rank, peer, expected, got)
    fields = [f"{f}={getattr(got, f)} (rank {r.rank} has {getattr(expected, f)})"
              for f in ("bits", "block_size", "numel", "rotated", "outliers") if getattr(got, f) != getattr(expected, f)]
    if got.average != expected.average:
        fields.append(f"op={_op(got)} (rank {r.rank} has {_op(expected)})")
    if got.error_feedback != expected.error_feedback:
        fields.append(f"error feedback {'on' if got.error_feedback else 'off'} "
                      f"(rank {r.rank} has it {'on' if expected.error_feedback else 'off'})")
    sizes = ""
    if got.payload_nbytes(r.rows) != expected.payload_nbytes(r.rows):
        sent, want_n = HEADER_BYTES + got.payload_nbytes(r.rows), HEADER_BYTES + expected.payload_nbytes(r.rows)
        sizes = (f"; rank {peer}'s frame is {sent} bytes where rank {r.rank} expects {want_n}, so the rest of it "
                 f"{'was cut off' if sent > want_n else 'never arrived'}")
    return RankMismatchError(
        f"{where} a frame with {', '.join(fields)}: rank {peer} sent {got.describe()}, rank {r.rank} expects "
        f"{expected.describe()}{sizes}{more}. Nothing was decoded. {_ADVICE}",
        r.op, r.rank, peer, expected, got)
