"""``QuantizedWeight``: one parameter's block-quantized values, as the codec packs them.

A parameter of ``shape`` is flattened row-major and cut into ``num_blocks`` blocks of
``block_size`` elements (the last zero-padded); ``codes[i]`` holds block ``i``'s packed
codes (``block_size * bits / 8`` bytes, the wire format's packing) and ``scales[i]`` its
fp32 scale. Dequantized values are ``q * scale`` in fp32, cast to ``dtype``: exactly what
:func:`qcoll.dequantize` gives for the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import format as fmt
from ..quant.bitpack import unpack_codes
from ..quant.api import Packed, dequantize, quantize


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor    # uint8 [num_blocks, block_size * bits // 8]
    scales: torch.Tensor   # float32 [num_blocks]
    shape: torch.Size
    dtype: torch.dtype     # the dtype the values dequantize to (the forward's compute dtype)
    bits: int
    block_size: int

    def __post_init__(self):
        fmt.check_bits(self.bits)
        fmt.check_block_size(self.block_size)
        nb = fmt.num_blocks(self.numel, self.block_size)
        cb = fmt.block_code_bytes(self.bits, self.block_size)
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (nb, cb):
            raise ValueError(f"codes must be uint8 of shape {(nb, cb)} for shape {tuple(self.shape)}, bits "
                             f"{self.bits}, block {self.block_size}; got {self.codes.dtype} {tuple(self.codes.shape)}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != (nb,):
            raise ValueError(f"scales must be float32 of shape {(nb,)}; got {self.scales.dtype} "
                             f"{tuple(self.scales.shape)}")
        if self.dtype not in fmt.FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, bfloat16 or float16, got {self.dtype}")

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def num_blocks(self) -> int:
        return fmt.num_blocks(self.numel, self.block_size)

    @classmethod
    def from_packed(cls, packed: Packed) -> "QuantizedWeight":
        """Split a codec buffer ``[codes | scales]`` into per-block codes and scales."""
        nb = packed.num_blocks
        cb = fmt.codes_nbytes(packed.numel, packed.bits, packed.block_size)
        data = packed.data.reshape(-1)
        codes = data[:cb].reshape(nb, fmt.block_code_bytes(packed.bits, packed.block_size)).clone()
        scales = data[cb:].clone().view(torch.float32)
        return cls(codes, scales, torch.Size(packed.shape), packed.dtype, packed.bits, packed.block_size)

    @classmethod
    def from_tensor(cls, x: torch.Tensor, bits: int, block_size: int) -> "QuantizedWeight":
        """Quantize ``x`` (round to nearest); values dequantize to ``x.dtype``."""
        return cls.from_packed(quantize(x, bits, block_size))

    def to_packed(self) -> Packed:
        data = torch.cat([self.codes.reshape(-1), self.scales.reshape(-1).view(torch.uint8)])
        return Packed(data, self.numel, self.bits, self.block_size, torch.Size(self.shape), self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values, of ``shape``, in ``dtype`` (default: ``self.dtype``)."""
        return dequantize(self.to_packed(), dtype=dtype)

    def int_codes(self) -> torch.Tensor:
        """The signed codes ``q`` as int8, ``[num_blocks, block_size]`` (padding included)."""
        return unpack_codes(self.codes, self.bits).clone()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 4 * self.scales.numel()
