"""qwZ: quantized weight all-gather."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import format as fmt
from ..quant import rows
from . import framing, validate
from .errors import RankMismatchError
from .handle import finish, wait_work
from .stats import stats


def all_gather_quantized(
    output: torch.Tensor,
    input: torch.Tensor,
    bits: int | None = 8,
    block_size: int = fmt.DEFAULT_WEIGHT_BLOCK,
    group=None,
    async_op: bool = False,
    secondary=None,
):
    """All-gather ``input`` into ``output`` with block quantization on the wire (qwZ).

    Argument shape as ``dist.all_gather_into_tensor``: ``output`` holds
    ``group_size * input.numel()`` elements, shard ``g`` at ``output.view(-1)[g*n:(g+1)*n]``.
    Each rank's shard is quantized to ``bits`` (8, 6, 4, 2; ``None`` is the plain,
    unquantized all-gather) with one fp32 scale per ``block_size`` elements, one
    uint8 buffer per rank is gathered, and every shard is dequantized into
    ``output`` in its dtype.

    ``secondary``: a :class:`qcoll.comm.SecondaryShard` to fill from the gathered
    buffers (hpZ; needs the world group). Returns a handle with ``wait()`` when
    ``async_op`` is true, else ``None``.

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
    size = dist.get_world_size(group)
    n = input.numel()
    if output.numel() != size * n:
        raise ValueError(
            f"output must have group size x input numel = {size} x {n} = {size * n} elements, got {output.numel()}"
        )
    if secondary is not None:
        secondary.check_gather(group, n, bits, block_size, input.dtype)
    validate.debug_check("all_gather", group, n, bits, block_size, input.dtype, input.device)
    src = input.contiguous()
    header = None if bits is None else framing.Header(bits, block_size, n)
    if header is None:
        wire = src.reshape(-1)
        recv = output.view(-1)
    else:
        wire = framing.frame(rows.quantize_rows(src.reshape(1, -1), bits, block_size), header).reshape(-1)
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
            try:
                payload = framing.unframe(shards, header, receipt)
            except RankMismatchError:
                if secondary is not None:
                    secondary.release()
                raise
        if secondary is not None:
            secondary.keep(shards)
        if header is not None:
            rows.dequantize_rows_into(payload, n, bits, block_size, output.view(size, n))
        return output

    return finish(complete, async_op)


def _receipt(group):
    """Builds, on a mismatch only, who sent each gathered frame (rows are the group's ranks in order)."""
    def build():
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        return framing.Receipt("all_gather", dist.get_rank(), lambda i: ranks[i])
    return build


def _sent(header, n: int, nbytes: int) -> str:
    what = "an unquantized shard" if header is None else f"a frame ({header.describe()})"
    return f"{what} of {nbytes} bytes for {n} elements"


def all_gather_int8(output, input, block_size: int = fmt.DEFAULT_WEIGHT_BLOCK, group=None, async_op=False,
                    secondary=None):
    """:func:`all_gather_quantized` with ``bits=8``."""
    return all_gather_quantized(output, input, 8, block_size, group, async_op, secondary)
