"""The quantized-weights file: safetensors with per-parameter codes and scales.

Layout (``FORMAT_VERSION`` 1; docs/EXPORT.md):

* ``<key>.qcodes``: uint8 ``[num_blocks, block_size * bits / 8]``, the codec's packed codes of
  parameter ``<key>`` (its state-dict key), flattened row-major, blocks of ``block_size``;
* ``<key>.qscales``: float32 ``[num_blocks]``, the blocks' scales;
* ``<key>``: a tensor stored as it is (buffers, anything not quantized);
* metadata (all strings): ``format`` = ``qcoll.quantized``, ``format_version``, ``bits``,
  ``block_size``, ``tensors`` (JSON: key -> ``{"shape", "dtype", "orig_dtype"}``, ``dtype`` being
  what the values dequantize to), ``aliases`` (JSON: tied key -> the key that holds its codes).

A value is ``q * scale`` in fp32 (``q`` the signed code), then cast to ``dtype``.
"""
from __future__ import annotations

import json
import os

import torch

from .record import QuantizedWeight

FORMAT = "qcoll.quantized"
FORMAT_VERSION = 1
CODES, SCALES = ".qcodes", ".qscales"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a qcoll quantized-weights file")
    return value


def save(path, weights: dict[str, QuantizedWeight], plain: dict[str, torch.Tensor] | None = None,
         aliases: dict[str, str] | None = None, orig_dtypes: dict[str, torch.dtype] | None = None) -> None:
    """Write ``weights`` (all of one ``bits``/``block_size``), ``plain`` tensors and ``aliases``
    to ``path`` atomically (a temporary file in the same directory, then a rename)."""
    from safetensors.torch import save_file

    plain, aliases, orig_dtypes = plain or {}, aliases or {}, orig_dtypes or {}
    formats = {(w.bits, w.block_size) for w in weights.values()}
    if len(formats) > 1:
        raise ValueError(f"all weights of one file share bits and block size, got {sorted(formats)}")
    bits, block = formats.pop() if formats else (0, 0)
    tensors, info = {}, {}
    for key, w in weights.items():
        tensors[key + CODES] = w.codes.detach().cpu().contiguous()
        tensors[key + SCALES] = w.scales.detach().cpu().contiguous()
        info[key] = {"shape": list(w.shape), "dtype": _dtype_name(w.dtype),
                     "orig_dtype": _dtype_name(orig_dtypes.get(key, w.dtype))}
    for key, t in plain.items():
        if key in info or key + CODES in tensors:
            raise ValueError(f"key {key!r} is both quantized and plain")
        tensors[key] = t.detach().cpu().contiguous()
    for key, target in aliases.items():
        if target not in info and target not in plain:
            raise ValueError(f"alias {key!r} -> {target!r}: no such tensor")
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "bits": str(bits), "block_size": str(block),
            "tensors": json.dumps(info), "aliases": json.dumps(aliases)}
    path = os.fspath(path)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read(path):
    """``(weights, plain, aliases, metadata)`` of a file written by :func:`save`."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no quantized-weights file at {path!r}")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path!r} is not a qcoll quantized-weights file (metadata format="
                             f"{meta.get('format')!r}, expected {FORMAT!r})")
        if int(meta.get("format_version", -1)) != FORMAT_VERSION:
            raise ValueError(f"{path!r} has format_version {meta.get('format_version')!r}; this qcoll reads "
                             f"{FORMAT_VERSION}")
        info = json.loads(meta["tensors"])
        names = set(f.keys())
        bits, block = int(meta["bits"]), int(meta["block_size"])
        weights = {key: QuantizedWeight(f.get_tensor(key + CODES), f.get_tensor(key + SCALES),
                                        torch.Size(d["shape"]), _dtype(d["dtype"]), bits, block)
                   for key, d in info.items()}
        quantized = {key + suffix for key in info for suffix in (CODES, SCALES)}
        plain = {k: f.get_tensor(k) for k in names - quantized}
    return weights, plain, json.loads(meta["aliases"]), meta


def state_dict(path) -> dict[str, torch.Tensor]:
    """The file's values as a plain state dict: quantized tensors dequantized (to the dtype the
    forward used), plain ones as stored, tied keys sharing one tensor."""
    weights, plain, aliases, _ = read(path)
    out = {key: w.dequantize() for key, w in weights.items()}
    out.update(plain)
    for key, target in aliases.items():
        out[key] = out[target]
    return out


def load_quantized(path, model: torch.nn.Module, strict: bool = True) -> torch.nn.Module:
    """Load a quantized-weights file into ``model``, a plain module of the architecture that was
    exported (built from its config, e.g. ``AutoModelForCausalLM.from_config``), and return it.

    Needs no ``torch.distributed``. Every parameter gets the dequantized values that the
    training forward computed with (cast to the parameter's dtype; a model in the exported
    ``dtype``, fp32 by default, holds them exactly). ``strict`` as in ``load_state_dict``;
    a shape mismatch raises a ValueError naming the key.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    values = state_dict(path)
    own = model.state_dict(keep_vars=True)
    for key, value in values.items():
        if key in own and tuple(own[key].shape) != tuple(value.shape):
            raise ValueError(f"{key!r}: the file holds shape {tuple(value.shape)}, the model expects "
                             f"{tuple(own[key].shape)}")
    model.load_state_dict(values, strict=strict)
    return model
