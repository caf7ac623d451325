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

:func:`save` replaces the file atomically through ``<file>.tmp.<pid>.<random>`` in the same folder and
first removes such temporary files of the same name left by writers that died (their pid is no live
process). :func:`read` checks every field and raises a ValueError naming the file and the field.
"""
from __future__ import annotations

import json
import os
import re
import stat
from array import array
from itertools import accumulate

import torch

from .. import files
from ..quant import format as fmt
from .record import QuantizedWeight

FORMAT = "qcoll.quantized"
FORMAT_VERSION = 1
CODES, SCALES = ".qcodes", ".qscales"
TMP_INFIX = ".tmp."   # temporary files: <name>.tmp.<pid>.<random>, see _write_atomic


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
    to ``path`` atomically: :func:`_write_atomic` (the file is serialized in memory first, so
    this holds one more copy of it, about ``bits / 32`` of the fp32 parameters' size)."""
    from safetensors.torch import save as serialize

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
        if key in info or key in tensors:
            raise ValueError(f"key {key!r} is both quantized and plain (or names a quantized key's codes/scales)")
        tensors[key] = t.detach().cpu().contiguous()
    for key, target in aliases.items():
        if target not in info and target not in plain:
            raise ValueError(f"alias {key!r} -> {target!r}: no such tensor")
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "bits": str(bits), "block_size": str(block),
            "tensors": json.dumps(info), "aliases": json.dumps(aliases)}
    _write_atomic(os.fspath(path), serialize(tensors, metadata=meta))


def _write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``<path>.tmp.<pid>.<random>`` in ``path``'s folder, then rename it onto ``path``
    (:func:`qcoll.files.write_atomic`: never follows a symlink at either name, leaves nothing behind on
    failure). Temporary files of ``path`` left by writers that died mid-write are removed first
    (:func:`_remove_stale_temps`).
    """
    folder, base = os.path.split(os.path.abspath(path))
    _remove_stale_temps(folder, base)
    files.write_atomic(path, lambda f: f.write(data), prefix=f"{base}{TMP_INFIX}{os.getpid()}.")


def _remove_stale_temps(folder: str, base: str) -> list[str]:
    """Remove the regular files ``<base>.tmp.<pid>`` and ``<base>.tmp.<pid>.<8 hex digits>`` in ``folder``
    whose writer ``pid`` is no live process (a save killed mid-write); return their paths.

    Nothing else is touched: other names, a live writer's temporary file (``os.kill(pid, 0)`` succeeds
    or raises PermissionError: alive, another user's), this process's own. On a folder shared between
    hosts a pid is looked up on this host only. Only on POSIX (elsewhere ``os.kill`` would signal).
    """
    if os.name != "posix":
        return []
    pattern = re.compile(re.escape(base) + re.escape(TMP_INFIX) + r"([0-9]+)(?:\.[0-9a-f]{8})?")
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed   # the write itself will say why the folder is unusable
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        tmp = os.path.join(folder, name)
        try:
            if stat.S_ISREG(os.lstat(tmp).st_mode):
                os.unlink(tmp)
                removed.append(tmp)
        except FileNotFoundError:   # another writer removed it first
            pass
        except OSError:              # not ours to remove (permissions): leave it
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` may be a live process (True when unsure: a temporary file is kept then)."""
    if pid <= 0 or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):   # alive under another user; or cannot tell
        return True
    return True


def read(path):
    """``(weights, plain, aliases, metadata)`` of a file written by :func:`save`.

    Raises FileNotFoundError when there is no file at ``path``, and a ValueError naming ``path``
    and the offending metadata field or tensor for anything else wrong: not a safetensors file or a
    truncated one (safetensors' error as ``__cause__``), no qcoll metadata, an unknown
    ``format_version``, a missing or malformed field, codes or scales whose dtype or shape do not
    match ``bits``, ``block_size`` and the tensor's shape, an alias to no tensor. Only safetensors
    and JSON are parsed; nothing is unpickled. No size in the file is taken on trust: safetensors
    bounds the header and every tensor's bytes by the file's length, the metadata's JSON is refused
    nested deeper than its format (before it is parsed: no recursion), and a shape whose product
    overflows int64 or whose codes could not fit in the file is refused.
    """
    from safetensors import SafetensorError, safe_open

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no quantized-weights file at {path!r}")
    try:
        handle = safe_open(path, framework="pt")
    except SafetensorError as e:
        raise _bad(path, f"not a valid safetensors file ({e})") from e
    with handle as f:
        meta = f.metadata() or {}
        bits, block, info, aliases = _parse_metadata(path, meta, os.path.getsize(path))
        names = set(f.keys())
        weights = {key: _weight(path, f, names, key, d, bits, block) for key, d in info.items()}
        quantized = {key + suffix for key in info for suffix in (CODES, SCALES)}
        plain = {k: f.get_tensor(k) for k in names - quantized}
    for key, target in aliases.items():
        if target not in weights and target not in plain:
            raise _bad(path, f"metadata field 'aliases': {key!r} -> {target!r} names no tensor of the file")
    return weights, plain, aliases, meta


def _bad(path: str, what: str) -> ValueError:
    return ValueError(f"qcoll quantized-weights file {path!r}: {what}")


def _parse_metadata(path: str, meta: dict, size: int) -> tuple[int, int, dict, dict]:
    """``(bits, block_size, tensors, aliases)`` of the metadata of the file (of ``size`` bytes), each
    field checked."""
    if meta.get("format") != FORMAT:
        found = f"is {meta['format']!r}" if "format" in meta else "is missing"
        raise ValueError(f"{path!r} is not a qcoll quantized-weights file (metadata field 'format' {found}, "
                         f"expected {FORMAT!r})")
    version = _int_field(path, meta, "format_version")
    if version != FORMAT_VERSION:
        raise _bad(path, f"metadata field 'format_version' is {version}; this qcoll reads format version "
                         f"{FORMAT_VERSION}")
    bits, block = _int_field(path, meta, "bits"), _int_field(path, meta, "block_size")
    info = _json_field(path, meta, "tensors")
    if info:
        if bits not in fmt.VALID_BITS:
            raise _bad(path, f"metadata field 'bits' must be one of {fmt.VALID_BITS}, got {meta['bits']!r}")
        if not fmt.MIN_BLOCK <= block <= fmt.MAX_BLOCK or block & (block - 1):
            raise _bad(path, f"metadata field 'block_size' must be a power of two in [{fmt.MIN_BLOCK}, "
                             f"{fmt.MAX_BLOCK}], got {meta['block_size']!r}")
    for key, d in info.items():
        _check_entry(path, key, d, bits, size)
    aliases = _json_field(path, meta, "aliases")
    for key, target in aliases.items():
        if not isinstance(target, str):
            raise _bad(path, f"metadata field 'aliases': the target of {key!r} must be a string, got {target!r}")
    return bits, block, info, aliases


def _int_field(path: str, meta: dict, field: str) -> int:
    if field not in meta:
        raise _bad(path, f"metadata field {field!r} is missing")
    text = meta[field]
    if not (text.isascii() and text.isdigit()):
        raise _bad(path, f"metadata field {field!r} must be a non-negative integer, got {text!r}")
    return int(text)


#: how deep each JSON field nests: ``tensors`` {key: {"shape": [...], ...}}, ``aliases`` {key: target}
_JSON_DEPTH = {"tensors": 3, "aliases": 1}
_BRACKETS = str.maketrans("[{]}", "\x01\x01\xff\xff")


def _json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text``, found without parsing it (and without
    recursing): escapes and strings dropped, then the running count of the brackets left (+1 / -1)."""
    text = re.sub(r'"[^"]*"', "", text.replace("\\\\", "").replace('\\"', ""))
    steps = array("b", re.sub(r"[^\[\]{}]+", "", text).translate(_BRACKETS).encode("latin-1"))
    return max(accumulate(steps), default=0)


def _json_field(path: str, meta: dict, field: str) -> dict:
    if field not in meta:
        raise _bad(path, f"metadata field {field!r} is missing")
    depth = _json_depth(meta[field])
    if depth > _JSON_DEPTH[field]:   # json.loads recurses once per level: a RecursionError, not a ValueError
        raise _bad(path, f"metadata field {field!r} nests JSON arrays and objects {depth} deep; its format "
                         f"nests them at most {_JSON_DEPTH[field]} deep")
    try:
        value = json.loads(meta[field])
    except json.JSONDecodeError as e:
        raise _bad(path, f"metadata field {field!r} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise _bad(path, f"metadata field {field!r} must be a JSON object, got {type(value).__name__} "
                         f"{_short(meta[field])}")
    return value


def _check_entry(path: str, key: str, d, bits: int, size: int) -> None:
    """One entry of the ``tensors`` field: ``{"shape": [int >= 0, ...], "dtype": float dtype, "orig_dtype": dtype}``,
    the shape's product within int64 and its ``bits``-bit codes within the file's ``size`` bytes."""
    where = f"metadata field 'tensors', entry {key!r}"
    if not isinstance(d, dict):
        raise _bad(path, f"{where} must be a JSON object, got {_short(json.dumps(d))}")
    for field in ("shape", "dtype", "orig_dtype"):
        if field not in d:
            raise _bad(path, f"{where} lacks {field!r}")
    shape = d["shape"]
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in shape):
        raise _bad(path, f"{where}: 'shape' must be a list of integers >= 0, got {_short(json.dumps(shape))}")
    numel, limit = (0 if 0 in shape else 1), size * 8 // bits   # elements whose codes the file could hold
    for n in shape:   # (multiplied only while within the limit: a crafted shape builds no huge integer)
        if n >= 1 << 63 or numel > limit:
            break
        numel *= n
    if any(n >= 1 << 63 for n in shape) or numel > limit:
        raise _bad(path, f"{where}: 'shape' {_short(json.dumps(shape))} has more elements than the file's {size} "
                         f"bytes hold as {bits}-bit codes (or a dimension beyond int64)")
    names = [_dtype_name(t) for t in fmt.FLOAT_DTYPES]
    if d["dtype"] not in names:
        raise _bad(path, f"{where}: 'dtype' must be one of {names}, got {_short(json.dumps(d['dtype']))}")
    if not isinstance(d["orig_dtype"], str) or not isinstance(getattr(torch, d["orig_dtype"], None), torch.dtype):
        raise _bad(path, f"{where}: 'orig_dtype' must name a torch dtype, got {_short(json.dumps(d['orig_dtype']))}")


def _weight(path: str, f, names: set, key: str, d: dict, bits: int, block: int) -> QuantizedWeight:
    """The :class:`QuantizedWeight` of ``key``, its codes and scales checked against the metadata."""
    shape = torch.Size(d["shape"])
    nb = fmt.num_blocks(shape.numel(), block)
    expected = {CODES: (torch.uint8, (nb, fmt.block_code_bytes(bits, block))), SCALES: (torch.float32, (nb,))}
    got = {}
    for suffix, (dtype, dims) in expected.items():
        name = key + suffix
        if name not in names:
            raise _bad(path, f"tensor {name!r} is missing (metadata field 'tensors' lists {key!r})")
        t = got[suffix] = f.get_tensor(name)
        if t.dtype != dtype or tuple(t.shape) != dims:
            raise _bad(path, f"tensor {name!r} must be {_dtype_name(dtype)} of shape {dims} for {key!r} of shape "
                             f"{list(shape)} at 'bits' {bits}, 'block_size' {block}; got {_dtype_name(t.dtype)} "
                             f"{tuple(t.shape)}")
    try:
        return QuantizedWeight(got[CODES], got[SCALES], shape, _dtype(d["dtype"]), bits, block)
    except (ValueError, TypeError) as e:   # checked above; kept so that no check can go unnamed
        raise _bad(path, f"tensor {key!r}: {e}") from e


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


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
