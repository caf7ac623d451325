"""Quantized all-reduce over one group: a quantized reduce-scatter (all-to-all) and a
quantized all-gather of the reduced slices (HSDP's gradient all-reduce across nodes)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import all_gather_flat, group_ranks, group_size, my_rank
from ..quant import format as fmt
from ..quant import rows
from . import framing, validate
from .error_feedback import ErrorFeedback
from .errors import RankMismatchError
from .handle import finish, labelled, wait_work
from .reduce_scatter import OPS, all_to_all_frames
from .stats import stats


@labelled("qcoll::all_reduce")
def all_reduce_quantized(
    tensor: torch.Tensor,
    bits: int | None = 4,
    block_size: int = fmt.DEFAULT_GRAD_BLOCK,
    group=None,
    op: str = "sum",
    async_op: bool = False,
    error_feedback: ErrorFeedback | None = None,
):
    """All-reduce ``tensor`` in place over ``group`` with ``bits``-bit codes on the wire.

    ``tensor``: any shape, fp32 / bf16 / fp16, the same numel on every rank of ``group``.
    Two stages, each quantized with one fp32 scale per ``block_size`` elements:

    1. reduce-scatter: the flat tensor, zero-padded to ``g x S`` (``g`` the group's size,
       ``S = ceil(numel / g)``), goes out as ``g`` slices, slice ``j`` to the ``j``-th rank
       of the group (one all-to-all); each rank sums the ``g`` slices it received in fp32;
    2. all-gather: each rank's reduced slice (divided by ``g`` for ``op="avg"``) is
       quantized again and gathered; every rank decodes every slice, its own included,
       so all ranks end with the same values, bit for bit.

    Each rank sends ``2 (g-1) / g`` times the tensor's codes: at 4 bits about a quarter of a
    bf16 ring all-reduce's bytes, scales and 16-byte frame headers included. ``bits=None``
    is ``dist.all_reduce`` (``op="avg"`` divides by ``g``). Returns None, or with ``async_op``
    a handle whose ``wait()`` completes the call (both stages run at the launch).

    ``error_feedback``: this tensor's :class:`qcoll.comm.ErrorFeedback` (held by the caller, the
    same object on every call for this tensor): each stage quantizes its values plus the residual
    it failed to send last time, and keeps the new residual, so the rounding is fed back instead
    of lost (what makes 2 bits usable). The result of one call is still within the codec's bound
    of the compensated sum; over calls, the results sum to the exact sums within one call's
    rounding. Every rank of the group passes one or none (the frames say which).

    ``group`` may be a bare c10d group that :func:`qcoll.comm.c10d.accept_bare` let in
    (torchft's replica groups, :mod:`qcoll.integrations.torchft`).

    Ranks that disagree on ``bits``, ``block_size``, ``op``, error feedback or the size: stage 1's frame headers
    are checked on receipt; a rank that received a mismatching frame still takes part in
    stage 2, sending a poisoned header, so every rank raises
    :class:`qcoll.comm.RankMismatchError`. Where the buffers' sizes differ, gloo aborts a
    rank that receives more bytes than it expects (as for the other collectives).
    """
    validate.check_tensor(tensor, "tensor")
    validate.check_quant_args(bits, block_size)
    validate.check_async(async_op)
    validate.check_group(group)
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError(f"error_feedback must be a qcoll ErrorFeedback or None, got {type(error_feedback).__name__}")
    g = group_size(group)
    validate.debug_check("all_reduce", group, tensor.numel(), bits, block_size, tensor.dtype, tensor.device,
                         reduce_op=op)
    if bits is None or g == 1:
        if error_feedback is not None:
            raise ValueError(f"error_feedback needs a quantized all-reduce over 2 or more ranks, got bits={bits} "
                             f"over {g} rank(s): there is nothing to feed back")
        return _plain(tensor, group, g, op, async_op)
    flat = tensor.view(-1)
    S = -(-flat.numel() // g)
    ef = error_feedback
    if ef is not None:
        ef.bind(flat.numel(), g, tensor.device)
        ef.calls += 1
    padded = torch.zeros(g * S, dtype=tensor.dtype, device=tensor.device)
    padded[: flat.numel()].copy_(flat)
    header = framing.Header(bits, block_size, S, average=op == "avg", error_feedback=ef is not None)
    frames = framing.frame(_quantize(padded.view(g, S), ef, ef and ef.send, bits, block_size), header)
    recv, work = all_to_all_frames(frames, group, g)
    ranks = group_ranks(group)

    def receipt(stage: str):
        return lambda: framing.Receipt(f"all_reduce ({stage})", my_rank(group), lambda j: ranks[j])

    def complete():
        wait_work(work, "all_reduce (reduce-scatter)", lambda: f"frames of {frames.shape[1]} bytes ({header.describe()})",
                  group)
        failure = None
        try:
            got = framing.unframe(recv, header, receipt("reduce-scatter"))
            total = rows.dequantize_reduce(got.view(g, 1, -1), S, bits, block_size)[0]
            if op == "avg":
                total = total / g
            mine = framing.frame(_quantize(total.view(1, S) if ef is not None else total.to(tensor.dtype).view(1, S),
                                           ef, ef and ef.own, bits, block_size), header)
        except RankMismatchError as e:   # pass it on instead of leaving the peers waiting in stage 2
            failure = e
            mine = framing.frame(torch.zeros(1, header.payload_nbytes(), dtype=torch.uint8, device=tensor.device),
                                 header.poison())
        gathered = framing.receive_buffer(g, mine.shape[1], tensor.device)
        stats.add("all_gather", group, (g - 1) * mine.numel(), (g - 1) * framing.header_bytes())
        work2 = all_gather_flat(gathered.view(-1), mine.view(-1), group=group, async_op=True)
        wait_work(work2, "all_reduce (all-gather)", lambda: f"a frame of {mine.numel()} bytes ({header.describe()})",
                  group)
        if failure is not None:
            raise failure
        payload = framing.unframe(gathered, header, receipt("all-gather"))
        rows.dequantize_rows_into(payload, S, bits, block_size, padded.view(g, S))
        flat.copy_(padded[: flat.numel()])
        return tensor

    return finish(complete, async_op, "qcoll::all_reduce")


def _quantize(values: torch.Tensor, ef: ErrorFeedback | None, residual: torch.Tensor | None, bits: int,
              block_size: int) -> torch.Tensor:
    """Packed rows of ``values`` ``[rows, S]``; with ``ef``, of ``values + residual`` (one of its
    tensors), and the residual becomes what those rows lost (:meth:`ErrorFeedback.keep`)."""
    if ef is None:
        return rows.quantize_rows(values, bits, block_size)
    compensated = ErrorFeedback.compensate(values, residual)
    packed = rows.quantize_rows(compensated, bits, block_size)
    decoded = rows.dequantize_rows(packed, values.shape[1], bits, block_size, torch.float32)
    ef.keep(residual, compensated, decoded)
    return packed


def _plain(tensor, group, g, op, async_op):
    stats.add("all_reduce", group, 2 * (g - 1) * tensor.numel() * tensor.element_size() // g)
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)

    def complete():
        wait_work(work, "all_reduce", lambda: f"an unquantized tensor of {tensor.numel()} elements", group)
        if op == "avg":
            tensor.div_(g)
        return tensor

    return finish(complete, async_op, "qcoll::all_reduce")
