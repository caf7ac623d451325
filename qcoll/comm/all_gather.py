"""qwZ: quantized weight all-gather."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .c10d import all_gather_flat
from ..quant import format as fmt
from ..quant import rows
from . import validate
from .handle import finish
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
    """
    validate.check_tensor(output, "output")
    validate.check_tensor(input, "input", contiguous=False)
    validate.check_same(output, input, "output and input")
    validate.check_quant_args(bits, block_size)
    validate.check_async(async_op)
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
    if bits is None:
        wire = src.reshape(-1)
        recv = output.view(-1)
    else:
        wire = rows.quantize_rows(src.reshape(1, -1), bits, block_size).reshape(-1)
        recv = torch.empty(size * wire.numel(), dtype=torch.uint8, device=input.device)
    stats.add("all_gather", group, (size - 1) * wire.numel() * wire.element_size())
    work = all_gather_flat(recv, wire, group=group, async_op=True)

    def complete():
        work.wait()
        shards = recv.view(size, -1)
        if secondary is not None:
            secondary.keep(shards)
        if bits is not None:
            rows.dequantize_rows_into(shards, n, bits, block_size, output.view(size, n))
        return output

    return finish(complete, async_op)


def all_gather_int8(output, input, block_size: int = fmt.DEFAULT_WEIGHT_BLOCK, group=None, async_op=False,
                    secondary=None):
    """:func:`all_gather_quantized` with ``bits=8``."""
    return all_gather_quantized(output, input, 8, block_size, group, async_op, secondary)
