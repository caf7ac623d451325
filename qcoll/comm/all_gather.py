"""qwZ: quantized weight all-gather."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import format as fmt
from ..quant import outliers as reserve
from ..quant import rows
from . import framing, validate
from .handle import finish_with_result, labelled, wait_work
from .stats import stats


@dataclass(frozen=True, eq=False)
class AllGatherResult:
    """What a completed :func:`all_gather_quantized` gives back.

    ``output``: the caller's output tensor, now holding every rank's shard.
    ``rows``: what each rank of ``group`` sent, as received, one row per rank in group
    order: uint8 ``[group size, 16 + packed_nbytes(numel)]`` frames (header included,
    docs/FORMAT.md "Frames") when quantized, the ``[group size, numel]`` view of
    ``output`` when ``bits is None``. hpZ keeps its node's part of them
    (:meth:`qcoll.comm.SecondaryShard.keep`); drop the result to free them.
    ``numel``, ``bits``, ``block_size``, ``dtype``, ``group`` and ``outliers``: the gather's arguments.
    """

    output: torch.Tensor
    rows: torch.Tensor
    numel: int
    bits: int | None
    block_size: int
    dtype: torch.dtype
    group: object = None
    outliers: int = 0


@labelled("qcoll::qwZ")
def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    bits: int | None = 8,
    block_size: int = fmt.DEFAULT_WEIGHT_BLOCK,
    group=None,
    async_op: bool = False,
    outliers: int = 0,
):
    """All-gather ``input`` into ``output`` with block quantization on the wire (qwZ).

    Argument shape as ``dist.all_gather_into_tensor``: ``output`` holds
    ``group_size * input.numel()`` elements, shard ``g`` at ``output.view(-1)[g*n:(g+1)*n]``.
    Each rank's shard is quantized to ``bits`` (8, 6, 4, 2; ``None`` is the plain,
    unquantized all-gather) with one fp32 scale per ``block_size`` elements, one
    uint8 buffer per rank is gathered, and every shard is dequantized into
    ``output`` in its dtype.

    ``outliers=k`` (1 to 8) keeps each block's ``k`` largest-magnitude values exactly
    beside the codes (docs/FORMAT.md "Outlier reserve"; ``6k`` more bytes per block).

    Returns an :class:`AllGatherResult` (``output`` and the gathered packed rows, from
    which hpZ keeps a :class:`qcoll.comm.SecondaryShard`), or with ``async_op`` a handle
    whose ``wait()`` returns it. The collective keeps no state of its own.

    Ranks that disagree: each quantized buffer travels behind a 16-byte frame header
    (``bits``, ``block_size``, shard numel; docs/FORMAT.md "Frames"), and every rank
    checks all received headers before decoding, so a rank that passed a different
    shard size, ``bits`` or ``block_size`` makes every rank that received its buffer
    (and the rank itself) raise :class:`qcoll.comm.RankMismatchError`, in ``wait()``
    for async calls. Where the buffers' sizes differ, gloo aborts a rank that receives
    more bytes than it expects ("Received data size doesn't match expected size"); its
    peers then get the transport's error (with a note from qcoll) within the group's
    timeout. With ``bits=None`` the data goes straight into ``output`` unframed: on CPU
    a peer that sent a quantized frame is detected, a different shard size or dtype is
    not (only ``QCOLL_DEBUG=1`` compares those before communicating).
    """
    validate.check_tensor(output, "output")
    validate.check_tensor(input, "input", contiguous=False)
    validate.check_same(output, input, "output and input")
    validate.check_quant_args(bits, block_size)
    validate.check_async(async_op)
    validate.check_group(group)
    outliers = reserve.check_outliers(outliers, block_size)
    if outliers and bits is None:
        raise ValueError(f"outliers={outliers} needs quantized weights (bits is None)")
    size = dist.get_world_size(group)
    n = input.numel()
    if output.numel() != size * n:
        raise ValueError(
            f"output must have group size x input numel = {size} x {n} = {size * n} elements, got {output.numel()}"
        )
    validate.debug_check("all_gather", group, n, bits, block_size, input.dtype, input.device)
    src = input.contiguous()
    header = None if bits is None else framing.Header(bits, block_size, n, outliers=outliers)
    if header is None:
        wire = src.reshape(-1)
        recv = output.view(-1)
    else:
        wire = framing.frame(reserve.quantize_rows(src.reshape(1, -1), bits, block_size, outliers), header).reshape(-1)
        recv = framing.receive_buffer(size, wire.numel(), input.device).view(-1)
    nbytes = wire.numel() * wire.element_size()
    hb = 0 if header is None else framing.header_bytes()
    stats.add("all_gather", group, (size - 1) * nbytes, (size - 1) * hb)
    work = all_gather_flat(recv, wire, group=group, async_op=True)
    receipt = _receipt(group)

    def complete():
        wait_work(work, "all_gather", lambda: _sent(header, n, nbytes))
        if header is None:
            shards = output.view(size, n)
            framing.check_unframed(output.view(torch.uint8).view(size, -1), receipt)
        else:
            shards = recv.view(size, -1)
            payload = framing.unframe(shards, header, receipt)
            decode_into(payload, header, output.view(size, n))
        return AllGatherResult(output, shards, n, bits, block_size, input.dtype, group, outliers)

    return finish_with_result(complete, async_op, "qcoll::qwZ")


def decode_into(payload: torch.Tensor, header: framing.Header, out: torch.Tensor) -> None:
    """Dequantize checked ``payload`` rows ``[k, bytes]`` into ``out`` ``[k, numel]``."""
    if header.outliers:
        out.copy_(reserve.dequantize_rows_fp32(payload, header.numel, header.bits, header.block_size,
                                               header.outliers))
    else:
        rows.dequantize_rows_into(payload, header.numel, header.bits, header.block_size, out)


def _receipt(group):
    """Builds, on a mismatch only, who sent each gathered frame (rows are the group's ranks in order)."""
    def build():
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return framing.Receipt("all_gather", dist.get_rank(), lambda i: ranks[i])
    return build


def _sent(header, n: int, nbytes: int) -> str:
    what = "an unquantized shard" if header is None else f"a frame ({header.describe()})"
    return f"{what} of {nbytes} bytes for {n} elements"


def all_gather_int8(output, input, block_size: int = fmt.DEFAULT_WEIGHT_BLOCK, group=None, async_op=False):
    """:func:`all_gather_quantized` with ``bits=8``."""
    return all_gather_quantized(output, input, 8, block_size, group, async_op)
