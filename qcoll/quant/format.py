"""Constants, sizes and argument checks of the qcoll wire format (docs/FORMAT.md)."""
from __future__ import annotations

import math
import struct

import torch

from ..checks import check_int

VALID_BITS = (8, 6, 4, 2)
MIN_BLOCK, MAX_BLOCK = 32, 4096
DEFAULT_WEIGHT_BLOCK = 256
DEFAULT_GRAD_BLOCK = 128
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_BYTES = 4
NAN_SCALE_BITS = 0x7FC00000
FLT_MAX = 3.4028234663852886e38
SEED_LIMIT = 2**32


def qmax(bits: int) -> int:
    """Largest code magnitude for ``bits``-bit symmetric quantization."""
    return 2 ** (bits - 1) - 1


def check_bits(bits, name: str = "bits") -> int:
    """``bits`` if it is one of :data:`VALID_BITS`, else ``TypeError``/``ValueError`` naming ``name``."""
    check_int(bits, name)
    if bits not in VALID_BITS:
        raise ValueError(f"{name} must be one of {VALID_BITS}, got {bits}")
    return bits


def check_block_size(block_size, name: str = "block_size") -> int:
    """``block_size`` if it is a power of two in ``[MIN_BLOCK, MAX_BLOCK]``, else ``TypeError``/``ValueError``."""
    check_int(block_size, name)
    if not (MIN_BLOCK <= block_size <= MAX_BLOCK) or block_size & (block_size - 1):
        raise ValueError(
            f"{name} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block_size}"
        )
    return block_size


def check_seed(seed, name: str = "seed") -> int:
    """``seed`` if it is an int in ``[0, 2**32)``, else ``TypeError``/``ValueError`` naming ``name``."""
    return check_int(seed, name, minimum=0, maximum=SEED_LIMIT - 1)


def check_float_tensor(x, name: str) -> torch.Tensor:
    """``x`` if it is a float32, bfloat16 or float16 tensor, else ``TypeError`` naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype float32, bfloat16 or float16, got {x.dtype}")
    return x


def num_blocks(numel: int, block_size: int) -> int:
    """Blocks (scales) of a row of ``numel`` elements, the last one possibly partial."""
    return -(-numel // block_size)


def block_code_bytes(bits: int, block_size: int) -> int:
    """Bytes of one block's codes."""
    return block_size * bits // 8


def codes_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the codes section of one packed row."""
    return num_blocks(numel, block_size) * block_code_bytes(bits, block_size)


def packed_nbytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of one packed row ``[codes | scales]`` holding ``numel`` elements."""
    nb = num_blocks(numel, block_size)
    return nb * (block_code_bytes(bits, block_size) + SCALE_BYTES)


def rotation_scale(block_size: int) -> float:
    """The Hadamard rotation's normalization ``fp32(1 / sqrt(block_size))`` (docs/FORMAT.md
    "Rotation"), as the Python float holding that fp32 value."""
    return float(struct.unpack("<f", struct.pack("<f", 1.0 / math.sqrt(block_size)))[0])
