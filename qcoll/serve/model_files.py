"""What the server checks in a model's files before it trusts them (no file's code ever runs).

- :func:`regular_file`: the path is a regular file; else a ValueError saying what it is instead
  (missing, a folder, a character device such as ``/dev/zero`` behind a symlink, a FIFO, ...),
  never opened (a FIFO would block, a device never ends).
- :func:`config_file`: a Hugging Face ``config.json`` (or the folder holding one) that is a regular
  file of at most ``MAX_CONFIG_BYTES``, UTF-8 JSON nesting at most ``MAX_CONFIG_DEPTH`` deep (found
  without parsing: ``json.loads`` recurses once per level), an object; checked before transformers
  reads it.
- :func:`check_model_size`: the model a config describes, built on the meta device (nothing
  allocated), fits the weights file: it cannot have more parameters than the file's bytes hold at
  the format's fewest bits per value. Before the meta build, the config's layer count times its
  hidden size is bounded the same way (every decoder layer holds at least ``hidden_size`` values),
  so that a config asking for millions of layers is refused before it takes minutes to build.
"""
from __future__ import annotations

import json
import os
import stat

from ..quant.format import VALID_BITS
from .body import json_depth

#: the largest config.json read (real ones are a few KB)
MAX_CONFIG_BYTES = 4 << 20
#: the deepest nesting of arrays and objects in a config.json (real ones nest 3 or 4 deep)
MAX_CONFIG_DEPTH = 64

_KINDS = [(stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket")]


def regular_file(path: str, what: str) -> int:
    """The size of the regular file at ``path``; ValueError naming ``what`` and ``path`` otherwise."""
    try:
        st = os.stat(path)   # follows symlinks: what would be read
    except FileNotFoundError:
        link = f" (a symlink to {os.readlink(path)!r}, which does not exist)" if os.path.islink(path) else ""
        raise ValueError(f"{what} {path!r}: no such file{link}") from None
    except OSError as e:
        raise ValueError(f"{what} {path!r}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a file")
        link = f" (a symlink to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
        raise ValueError(f"{what} {path!r} is {kind}{link}, not a regular file")
    return st.st_size


def config_file(config) -> str:
    """The path of the checked ``config.json`` that ``config`` names (the file, or its folder)."""
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    size = regular_file(path, "config")
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"config {path!r} is {size} bytes; a model's config.json is at most {MAX_CONFIG_BYTES}")
    with open(path, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"config {path!r} is not JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = json_depth(text)
    if depth > MAX_CONFIG_DEPTH:
        raise ValueError(f"config {path!r} nests JSON arrays and objects {depth} deep; a model's config.json "
                         f"nests them at most {MAX_CONFIG_DEPTH} deep")
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"config {path!r} is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"config {path!r} must hold a JSON object, got {type(doc).__name__}")
    return path


def file_capacity(size: int) -> int:
    """The most values a quantized-weights file of ``size`` bytes can hold (all at the fewest bits)."""
    return size * 8 // min(VALID_BITS)


def _int_attr(cfg, *names) -> int | None:
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _refuse(config_path: str, weights_path: str, size: int, asks: str) -> ValueError:
    return ValueError(f"config {config_path!r} {asks}, but the weights file {weights_path!r} is {size:,} bytes: at "
                      f"{min(VALID_BITS)} bits per value (the format's fewest) it holds at most {file_capacity(size):,}"
                      " values; refusing to build the model (is this the config of another model?)")


def check_model_size(cfg, config_path: str, weights_path: str, size: int, build) -> int:
    """The parameter count of ``build()`` (called on the meta device) after checking that it and
    the config's layers fit the weights file's ``size`` bytes; ValueError naming both files otherwise."""
    import torch

    capacity = file_capacity(size)
    layers = _int_attr(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _int_attr(cfg, "hidden_size", "n_embd", "d_model")
    if layers is not None and layers * max(hidden or 1, 1) > capacity:
        raise _refuse(config_path, weights_path, size, f"asks for {layers:,} layers of hidden size {hidden or 1:,} "
                      f"(at least {layers * max(hidden or 1, 1):,} values)")
    try:
        with torch.device("meta"):
            model = build()
    except Exception as e:   # a config transformers accepted but cannot build (sizes, types)
        raise ValueError(f"config {config_path!r}: no model can be built from it ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from e
    count = sum(p.numel() for p in model.parameters())
    if count > capacity:
        raise _refuse(config_path, weights_path, size, f"describes a model of {count:,} parameters "
                      f"({count * 4 / 1e9:,.1f} GB as float32)")
    return count


__all__ = ["MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "regular_file", "config_file", "file_capacity",
           "check_model_size"]
