"""``export_quantized``: the weight-quantized model that ZeRO++ training leaves behind, as a file.

Each rank quantizes its fp32 master shard exactly as the forward's qwZ gather does (cast to
the compute dtype, the codec at the config's bits and weight block), the packed shards are
all-gathered (one group at a time, like the forward), and rank 0 cuts them into per-parameter
codes and scales: the block-aligned layout (:mod:`qcoll.zero.flat`) makes each parameter a
whole run of blocks, so its codes are the very bytes the forward dequantizes.
"""
from __future__ import annotations

import os

import torch

from ..comm.c10d import all_gather_flat
from ..quant import format as fmt
from ..quant import quantize
from ..weights import file as weights_file
from ..weights.record import QuantizedWeight
from .rank0 import on_rank0
from .state import state_of


def _group_weights(g, bits: int, block: int, dtype: torch.dtype) -> list[QuantizedWeight]:
    """The forward's codes of group ``g``'s parameters, on every rank (collective)."""
    W, S = g.topology.world_size, g.shard_numel
    mine = quantize(g.master.detach().to(dtype), bits, block).data
    every = torch.empty(W * mine.numel(), dtype=torch.uint8, device=mine.device)
    all_gather_flat(every, mine)
    rows = every.view(W, -1).cpu()
    per_rank = S // block
    cb = fmt.block_code_bytes(bits, block)
    codes = rows[:, : per_rank * cb].reshape(W * per_rank, cb)
    scales = rows[:, per_rank * cb:].contiguous().view(torch.float32).reshape(-1)
    out = []
    for off, n, shape in zip(g.offsets, g.numels, g.shapes):
        first, count = off // block, fmt.num_blocks(n, block)
        out.append(QuantizedWeight(codes[first:first + count].clone(), scales[first:first + count].clone(),
                                   torch.Size(shape), dtype, bits, block))
    return out


def export_quantized(model, path) -> None:
    """Write the weight-quantized model to ``path`` (a safetensors file; collective: call it on
    every rank, rank 0 writes).

    Every parameter is stored as the codes and fp32 scales that a forward of ``model`` gathers
    now with qwZ (the config's ``weight_bits`` and ``weight_block``, from the master weights cast
    to the compute dtype): those of the last training forward when no optimizer step has run
    since, and of every later forward otherwise. Dequantized (:func:`qcoll.weights.load_quantized`)
    they are bit-identical to the weights that forward computes with. Buffers are stored as they
    are; tied parameters once, with an alias. The file is about ``P * bits / 8 + 4 * P / block``
    bytes for ``P`` parameters and is replaced atomically. Format: :mod:`qcoll.weights.file`.

    Raises ValueError when the model's config does not quantize weights (``weight_bits=None``,
    the ZeRO-3 baseline): its forward has no codes to export.
    """
    state = state_of(model)
    config = state.config
    if config.weight_bits is None:
        raise ValueError("export_quantized: the model's ZeroConfig has weight_bits=None (unquantized weight "
                         "gathers), so its forward uses no codes to export; use model.state_dict() instead")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    state.engine.wait_reduces()
    if config.weight_outliers:
        raise ValueError(f"export_quantized: weight_outliers={config.weight_outliers} is not in the quantized-weights "
                         "file format (format v1 holds plain codes and scales); export from a config without it")
    bits, block = config.weight_bits, config.weight_block
    by_param = {}
    for g in state.groups:
        if g.replicated:  # persistent parameters: the forward uses them unquantized; stored plain
            g.gather_now(backward=False)  # (their values as of the master now)
            continue
        if not g.params:
            continue
        for p, w, orig in zip(g.params, _group_weights(g, bits, block, config.dtype), g.orig_dtypes):
            by_param[id(p)] = (w, orig)
    weights, plain, aliases, orig_dtypes, first_key = {}, {}, {}, {}, {}
    for key, value in model._plain_state_dict().items():
        if id(value) in first_key:
            aliases[key] = first_key[id(value)]
        elif id(value) in by_param:
            first_key[id(value)] = key
            weights[key], orig_dtypes[key] = by_param[id(value)]
        else:
            first_key[id(value)] = key
            plain[key] = value.detach()
    on_rank0(weights_file.save, path, weights, plain, aliases, orig_dtypes)
