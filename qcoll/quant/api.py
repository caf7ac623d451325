"""Public codec API: :func:`quantize`, :func:`dequantize` and :class:`Packed`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_bool, check_int
from . import format as fmt
from . import rows


@dataclass(frozen=True)
class Packed:
    """A block-quantized tensor: one contiguous uint8 buffer ``[codes | scales]``.

    ``data`` is fully determined by (``numel``, ``bits``, ``block_size``); ``shape``
    and ``dtype`` record the original tensor so :func:`dequantize` can restore it.
    """

    data: torch.Tensor
    numel: int
    bits: int
    block_size: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Size of the packed buffer in bytes (what a collective moves)."""
        return self.data.numel()

    @property
    def num_blocks(self) -> int:
        return fmt.num_blocks(self.numel, self.block_size)

    @property
    def scales(self) -> torch.Tensor:
        """The fp32 per-block scales (a copy)."""
        cb = fmt.codes_nbytes(self.numel, self.bits, self.block_size)
        if self.num_blocks == 0:
            return torch.empty(0, dtype=torch.float32, device=self.data.device)
        return self.data[cb:].clone().view(torch.float32)


def quantize(
    x: torch.Tensor,
    bits: int = 8,
    block_size: int = fmt.DEFAULT_WEIGHT_BLOCK,
    stochastic: bool = False,
    seed: int = 0,
) -> Packed:
    """Block-quantize ``x`` (fp32, bf16 or fp16, any shape) into a :class:`Packed` buffer.

    Args:
        x: the tensor; non-contiguous inputs are accepted.
        bits: code width, one of 8, 6, 4, 2.
        block_size: elements per scale, a power of two in [32, 4096].
        stochastic: round stochastically (unbiased) instead of to nearest.
        seed: stochastic-rounding seed in [0, 2**32); same seed, same bytes.
    """
    fmt.check_float_tensor(x, "x")
    fmt.check_bits(bits)
    fmt.check_block_size(block_size)
    check_bool(stochastic, "stochastic")
    fmt.check_seed(seed)
    flat = x.contiguous().reshape(1, -1)
    data = rows.quantize_rows(flat, bits, block_size, stochastic, seed).reshape(-1)
    return Packed(data, x.numel(), bits, block_size, x.shape, x.dtype)


def dequantize(packed: Packed, out: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Restore a :class:`Packed` tensor.

    Returns a tensor of ``packed.shape`` in ``dtype`` (default ``packed.dtype``),
    or writes into ``out`` (same number of elements, a float dtype, the buffer's
    device) and returns it.
    """
    if not isinstance(packed, Packed):
        raise TypeError(f"packed must be a qcoll Packed, got {type(packed).__name__}")
    check_int(packed.numel, "packed.numel", minimum=0)
    fmt.check_bits(packed.bits, "packed.bits")
    fmt.check_block_size(packed.block_size, "packed.block_size")
    if not isinstance(packed.data, torch.Tensor):
        raise TypeError(f"packed.data must be a torch.Tensor, got {type(packed.data).__name__}")
    expected = fmt.packed_nbytes(packed.numel, packed.bits, packed.block_size)
    if packed.data.dtype != torch.uint8 or packed.data.numel() != expected:
        raise ValueError(
            f"packed.data must be {expected} uint8 bytes for numel={packed.numel}, bits={packed.bits}, "
            f"block_size={packed.block_size}; got {packed.data.numel()} {packed.data.dtype}"
        )
    if dtype is not None and dtype not in fmt.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if out is not None:
        fmt.check_float_tensor(out, "out")
        if out.numel() != packed.numel:
            raise ValueError(f"out must have {packed.numel} elements, got {out.numel()} (shape {tuple(out.shape)})")
        if dtype is not None and dtype != out.dtype:
            raise TypeError(f"dtype={dtype} contradicts out.dtype={out.dtype}")
        if out.device != packed.data.device:
            raise ValueError(f"out is on {out.device} but packed.data is on {packed.data.device}")
    buf = packed.data.reshape(1, -1)
    if out is None:
        flat = rows.dequantize_rows(buf, packed.numel, packed.bits, packed.block_size, dtype or packed.dtype)
        return flat.reshape(packed.shape)
    if out.is_contiguous():
        rows.dequantize_rows_into(buf, packed.numel, packed.bits, packed.block_size, out.view(1, -1))
    else:
        out.copy_(rows.dequantize_rows(buf, packed.numel, packed.bits, packed.block_size, out.dtype).view(out.shape))
    return out


def packed_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the packed buffer for ``numel`` elements (validates its arguments)."""
    check_int(numel, "numel", minimum=0)
    return fmt.packed_nbytes(numel, fmt.check_bits(bits), fmt.check_block_size(block_size))


__all__ = ["Packed", "quantize", "dequantize", "packed_nbytes"]
