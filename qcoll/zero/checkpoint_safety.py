"""What :func:`qcoll.zero.load` trusts in a checkpoint directory: no code from it runs, and no size
it claims allocates more than its files hold.

A ``torch.distributed.checkpoint`` (DCP) directory holds a pickled ``.metadata`` file and data
files ``__<rank>_<n>.distcp``. DCP itself reads ``.metadata`` with ``pickle.load`` and every
non-tensor (``BYTE_IO``) entry with ``torch.load(weights_only=False)``: a crafted directory would
run any code on every loading rank. Here instead:

* :func:`read_metadata` unpickles ``.metadata`` (read whole first) with :class:`MetadataUnpickler`,
  which resolves only DCP's metadata classes and the torch and standard-library types they hold;
  any other global is refused with an :class:`UnsafeCheckpointError` naming the file and the global.
  Then no ``BYTE_IO`` entry (qcoll stores none); data locations are untransformed ranges of the
  directory's ``__<rank>_<n>.distcp`` files; a tensor's chunks lie inside it, cover it and fit their
  ranges, so its size is bounded by recorded lengths, which :class:`SafeReader` (and
  ``upgrade_checkpoint``) bound by the files' own.
* :class:`SafeReader` is DCP's ``FileSystemReader`` with that ``read_metadata`` (tensors are read
  with ``torch.load(weights_only=True)``); a data file too short for its entries, or failing to
  read, is reported by name, and an entry's records must be stored uncompressed within it.
* qcoll's non-tensor values (optimizer hyper-parameters, the parameter layout) are JSON text in a
  uint8 tensor (:func:`json_tensor`), tuples, dicts and tensors tagged (:func:`encode_value`).
* :func:`summarize` turns DCP's ``CheckpointException`` (every rank's traceback) into one line.

``upgrade_checkpoint`` (:mod:`qcoll.zero.checkpoint_upgrade`, importable from here) converts the
earlier format (hyper-parameters as pickles).
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import numbers
import os
import pickle
import re

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorStorageMetadata)
from torch.futures import Future

from .. import files

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATHS = ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")
#: every global a DCP ``.metadata`` file may name (found by pickling real qcoll checkpoints'
#: metadata), besides the ``torch.<dtype>`` names
ALLOWED_GLOBALS = frozenset(
    {(_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                  "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
       ("builtins", "set"), ("builtins", "frozenset")}
    | {(m, n) for m in ("pathlib", "pathlib._local") for n in _PATHS})
_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")
_LEGACY_KEY = re.compile(r"optim\.param_groups\.\d+\.[A-Za-z_]\w*")
_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")


def __getattr__(name: str):  # upgrade_checkpoint, imported when asked for (its module imports this one)
    if name == "upgrade_checkpoint":
        from .checkpoint_upgrade import upgrade_checkpoint
        return upgrade_checkpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds something that loading would have to execute, or that is not DCP's."""


class CheckpointError(RuntimeError):
    """A save or load failed on some rank (the DCP exception with every rank's error is ``__cause__``)."""


class CheckpointOSError(OSError):
    """A save or load failed on some rank with an OSError (``errno``/``filename`` are the first cause's)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class MetadataUnpickler(pickle._Unpickler):
    """Unpickles a DCP ``.metadata`` file, resolving only :data:`ALLOWED_GLOBALS` and torch dtypes.

    The pure-Python unpickler, so that BUILD (which sets attributes of the object below it) can be
    checked too: it may fill in an instance of an allowed class, never a class itself (a crafted
    file could otherwise change ``pathlib.Path`` or a DCP class for the rest of the process)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def load_build(self):
        target = self.stack[-2] if len(self.stack) >= 2 else None
        cls = type(target)
        if isinstance(target, type) or (cls.__module__, cls.__qualname__) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(f"{self.path}: refusing to set the attributes of a {cls.__name__} "
                                        f"({target!r:.80}) while unpickling: only instances of the DCP metadata "
                                        "classes are built from a checkpoint's metadata")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module: str, name: str):
        allowed = (module, name) in ALLOWED_GLOBALS or (
            module == "torch" and isinstance(vars(torch).get(name), torch.dtype))  # dtypes pickle as torch.<name>
        if allowed:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        raise UnsafeCheckpointError(
            f"{self.path}: refusing to unpickle the global {module}.{name}: a checkpoint's metadata holds only "
            "torch.distributed.checkpoint metadata classes, and loading this would run other code (a crafted file, "
            "or one not written by torch.distributed.checkpoint)")


def _fail(path, what: str):
    raise UnsafeCheckpointError(f"{path}: {what}")


def _check_structure(md, path: str, allow_bytes: bool) -> None:
    if not isinstance(md, Metadata):
        _fail(path, f"holds a {type(md).__name__}, not torch.distributed.checkpoint Metadata")
    entries = md.state_dict_metadata
    if not isinstance(entries, dict):
        _fail(path, "state_dict_metadata is not a dict")
    for key, entry in entries.items():
        if not isinstance(key, str):
            _fail(path, f"holds a key of type {type(key).__name__}: {key!r}")
        if isinstance(entry, TensorStorageMetadata):
            if not isinstance(entry.size, torch.Size) or not isinstance(getattr(entry.properties, "dtype", None),
                                                                        torch.dtype):
                _fail(path, f"entry {key!r} has no valid size or dtype")
            if not all(isinstance(c, ChunkStorageMetadata) for c in entry.chunks):
                _fail(path, f"entry {key!r} has chunks that are not ChunkStorageMetadata")
        elif not isinstance(entry, BytesStorageMetadata):
            _fail(path, f"entry {key!r} is a {type(entry).__name__}")
    pickled = [k for k, v in entries.items() if isinstance(v, BytesStorageMetadata)]
    if pickled and not allow_bytes:
        shown = ", ".join(map(repr, pickled[:4])) + (f" and {len(pickled) - 4} more" if len(pickled) > 4 else "")
        if all(_LEGACY_KEY.fullmatch(k) for k in pickled):
            _fail(path, f"written by an earlier qcoll, which stored the optimizer's hyper-parameters as pickles "
                  f"({shown}); loading those would run torch.load(weights_only=False) on the file's bytes, which "
                  "runs any code a crafted file holds. Convert it once with qcoll.zero.checkpoint_safety."
                  f"upgrade_checkpoint({os.path.dirname(path)!r}) (reads them with torch.load(weights_only=True)), "
                  "then load it again")
        _fail(path, f"holds non-tensor (BYTE_IO) entries {shown}: torch.distributed.checkpoint would read them with "
              "torch.load(weights_only=False), which runs any code the file holds; qcoll checkpoints hold none, "
              "refusing to load")
    storage = md.storage_data
    if not isinstance(storage, dict):
        _fail(path, "storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            _fail(path, f"storage_data maps a {type(index).__name__} to a {type(info).__name__}")
        name = info.relative_path
        if not isinstance(name, str) or not _DATA_FILE.fullmatch(name):
            _fail(path, f"the data of {index.fqn!r} is in {name!r}, not a __<rank>_<n>.distcp file of the directory")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length)):
            _fail(path, f"the data location of {index.fqn!r} is not a valid offset and length")
        if info.transform_descriptors:  # (compressed: its size would not be bounded by the file's; qcoll writes none)
            _fail(path, f"the data of {index.fqn!r} is transformed ({info.transform_descriptors!r:.80})")
    for key, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_chunks(path, key, entry, storage)
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        _fail(path, f"storage_meta is a {type(md.storage_meta).__name__}")


def _check_chunks(path: str, key: str, entry: TensorStorageMetadata, storage: dict) -> None:
    """The chunks of ``entry`` lie inside it at distinct offsets, cover it, and fit their data's lengths."""
    size, dtype, seen = entry.size, entry.properties.dtype, set()
    for c in entry.chunks:
        if not (isinstance(c.offsets, torch.Size) and isinstance(c.sizes, torch.Size) and c.offsets not in seen
                and len(c.offsets) == len(size) == len(c.sizes)
                and all(o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(c.offsets, c.sizes, size))):
            _fail(path, f"entry {key!r} of size {list(size)} has a chunk of size {c.sizes!r:.60} at {c.offsets!r:.60}")
        seen.add(c.offsets)
        info, nbytes = storage.get(MetadataIndex(key, c.offsets)), math.prod(c.sizes) * dtype.itemsize
        if nbytes and (info is None or nbytes > info.length):
            _fail(path, f"entry {key!r}: its chunk at {list(c.offsets)} ({nbytes} bytes of {dtype}) has "
                  + (f"{info.length} bytes in {info.relative_path}" if info else "no data"))
    if sum(math.prod(c.sizes) for c in entry.chunks) < math.prod(size):
        _fail(path, f"entry {key!r} of size {list(size)}: its chunks do not cover it")


def read_metadata(checkpoint_dir, *, allow_bytes: bool = False, rank: int | None = None) -> Metadata:
    """The DCP ``Metadata`` of ``checkpoint_dir`` (its ``.metadata``, or ``__<rank>.metadata``), read
    without running code from it (:class:`MetadataUnpickler`) and checked (see the module docstring).

    UnsafeCheckpointError (a ValueError) naming the file on anything else; FileNotFoundError
    when it is missing. ``allow_bytes`` lets ``BYTE_IO`` entries through (for
    :func:`upgrade_checkpoint`, which reads them with ``torch.load(weights_only=True)``)."""
    path = os.path.join(os.fspath(checkpoint_dir), ".metadata" if rank is None else f"__{rank}.metadata")
    with open(path, "rb") as f:
        data = f.read()  # whole: a length in the pickle then reads (allocates) at most what the file holds
    try:
        md = MetadataUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # truncated, not a pickle, a class refusing its state
        raise UnsafeCheckpointError(f"{path}: not a readable torch.distributed.checkpoint metadata file "
                                    f"({type(e).__name__}: {e})") from e
    _check_structure(md, path, allow_bytes)
    return md


class SafeReader(dcp.FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is :func:`read_metadata`'s (or ``metadata``, already
    read that way); a data file that is too short or fails to read raises naming the file, and so does
    an entry whose records claim more than it holds (``torch.load`` would allocate what they claim)."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        md = self._metadata if self._metadata is not None and rank is None else read_metadata(self.path, rank=rank)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            path = os.path.join(self.path, name)
            need = max(self.storage_data[i.storage_index].offset + self.storage_data[i.storage_index].length
                       for i in items)
            size = os.path.getsize(path)  # FileNotFoundError names the file
            if size < need:
                raise RuntimeError(f"checkpoint file {path!r} is truncated: {size} bytes, its entries need {need} "
                                   "(a save that was cut short, or a damaged copy)")
            with open(path, "rb") as f:
                for i, info in ((i, self.storage_data[i.storage_index]) for i in items):
                    try:
                        files.check_stored_zip(f, info.offset, info.length)
                    except ValueError as e:
                        raise RuntimeError(f"checkpoint file {path!r}: the data of {i.storage_index.fqn!r}: {e}") from e
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except OSError:
                raise
            except Exception as e:
                raise RuntimeError(f"reading checkpoint file {path!r}: {type(e).__name__}: {e}") from e
        fut: Future = Future()
        fut.set_result(None)
        return fut


# --- non-tensor values as JSON in a uint8 tensor ------------------------------------------------

def encode_value(value, where: str):
    """``value`` as JSON-able data: None, bool, int, float, str as they are, lists as lists; tuples,
    dicts (str keys) and tensors tagged. TypeError naming ``where`` for anything else."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        items = [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"tuple": items} if isinstance(value, tuple) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode_value(v, f"{where}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, torch.Tensor) and str(value.dtype).removeprefix("torch.") in _DTYPES:
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    raise TypeError(f"qcoll.zero.save: {where} is a {type(value).__name__} ({value!r:.80}); a checkpoint stores only "
                    "None, bool, int, float, str, lists, tuples, dicts with str keys and real or bool tensors")


def decode_value(data, where: str):
    """Inverse of :func:`encode_value`; ValueError naming ``where`` on anything it did not write."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1 and isinstance(data.get("tuple"), list):
        return tuple(decode_value(v, f"{where}[{i}]") for i, v in enumerate(data["tuple"]))
    if isinstance(data, dict) and len(data) == 1 and isinstance(data.get("dict"), dict):
        return {k: decode_value(v, f"{where}[{k!r}]") for k, v in data["dict"].items()}
    if isinstance(data, dict) and data.keys() == {"tensor", "dtype"} and data["dtype"] in _DTYPES:
        try:
            return torch.tensor(data["tensor"], dtype=getattr(torch, data["dtype"]))
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{where}: not a valid tensor value: {e}") from e
    raise ValueError(f"{where}: unexpected value {data!r:.80}")


def json_tensor(obj) -> torch.Tensor:
    """JSON-able ``obj`` as UTF-8 text in a 1-D uint8 tensor."""
    return torch.frombuffer(bytearray(json.dumps(obj, separators=(",", ":")).encode()), dtype=torch.uint8)


def from_json_tensor(t: torch.Tensor, where: str):
    """Inverse of :func:`json_tensor`; ValueError naming ``where`` when it is not JSON."""
    try:
        return json.loads(bytes(t.detach().cpu().to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"{where}: not valid JSON text ({e})") from e


def encode_param_groups(groups: list[dict]) -> torch.Tensor:
    """An optimizer's ``param_groups`` hyper-parameters (not ``params``) as a JSON uint8 tensor."""
    return json_tensor({"qcoll_param_groups": 1, "groups": [
        {k: encode_value(v, f"param_groups[{i}][{k!r}]") for k, v in g.items() if k != "params"}
        for i, g in enumerate(groups)]})


def decode_param_groups(t: torch.Tensor, where: str) -> list[dict]:
    """Inverse of :func:`encode_param_groups`."""
    data = from_json_tensor(t, where)
    if not isinstance(data, dict) or data.get("qcoll_param_groups") != 1 or not isinstance(data.get("groups"), list):
        raise ValueError(f"{where}: not qcoll's optimizer hyper-parameters (format 1)")
    for i, g in enumerate(data["groups"]):
        if not isinstance(g, dict) or "params" in g:
            raise ValueError(f"{where}[{i}]: not a param group's hyper-parameters: {g!r:.80}")
    return [{k: decode_value(v, f"{where}[{i}][{k!r}]") for k, v in g.items()} for i, g in enumerate(data["groups"])]


# --- errors ------------------------------------------------------------------------------------

def summarize(e: BaseException, what: str) -> Exception:
    """One exception for DCP's ``CheckpointException`` ``e``: a one-line message naming the first
    failed rank and its error, a :class:`CheckpointOSError` when that error is an OSError (errno
    and filename kept), else a :class:`CheckpointError`. Raise it ``from e``."""
    failures = getattr(e, "failures", None) or {}
    if not failures:
        return CheckpointError(f"{what}: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}")
    rank = min(failures)
    cause = failures[rank]
    if isinstance(cause, tuple) and cause and isinstance(cause[0], BaseException):
        cause = cause[0]  # DCP's (exception, traceback summary)
    text = str(cause) if isinstance(cause, OSError) else f"{type(cause).__name__}: {cause}"
    text = " / ".join(line.strip() for line in text.splitlines() if line.strip())
    if len(text) > 600:
        text = text[:600] + " ..."
    others = f" (and {len(failures) - 1} other rank{'s' if len(failures) > 2 else ''})" if len(failures) > 1 else ""
    message = f"{what}: rank {rank} failed{others}: {text}"
    if isinstance(cause, OSError):
        err = CheckpointOSError(message)
        err.errno, err.strerror, err.filename = cause.errno, cause.strerror, cause.filename
        return err
    return CheckpointError(message)


# --- differences between a checkpoint and the state it is loaded into ----------------------------

def _keys(keys: list[str], limit: int = 12) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def differences(expected: dict, md: Metadata, owned: tuple[str, ...], optional: tuple[str, ...] = ()) -> list[str]:
    """What differs between ``expected`` (key -> global ``torch.Size``, or None for any size) and the
    checkpoint's tensors: missing keys, unexpected keys (those starting with one of ``owned``, other
    than ``optional``), size mismatches. Empty when they agree."""
    entries = md.state_dict_metadata
    missing = [k for k in expected if k not in entries]
    unexpected = [k for k in entries if k.startswith(owned) and k not in expected and k not in optional]
    out = []
    if missing:
        out.append(f"missing keys (the model has them, the checkpoint does not): {_keys(missing)}")
    if unexpected:
        out.append(f"unexpected keys (the checkpoint has them, the model does not): {_keys(unexpected)}")
    for k, size in expected.items():
        if k in entries and size is not None and entries[k].size != size:
            out.append(f"size mismatch for {k}: {list(entries[k].size)} in the checkpoint, {list(size)} in the model")
    return out


def layout_differences(saved, model: dict[str, list]) -> list[str]:
    """Per group present in both: the parameters (``[name, shape]`` lists) that differ."""
    if not isinstance(saved, dict) or not isinstance(saved.get("groups"), dict):
        return ["model.layout: not qcoll's parameter layout"]
    out = []
    for group, params in model.items():
        theirs = saved["groups"].get(group)
        if not isinstance(theirs, list) or theirs == params:
            continue  # a group only on one side is a missing or unexpected key already
        try:
            shapes = {str(n): list(s) for n, s in theirs}
        except (TypeError, ValueError):
            out.append(f"group {group!r}: the checkpoint's layout is not a list of [name, shape]")
            continue
        mine = {n: s for n, s in params}
        only_ck = [n for n in shapes if n not in mine]
        only_model = [n for n in mine if n not in shapes]
        if only_ck:
            out.append(f"group {group!r}: parameters only in the checkpoint: {_keys(only_ck)}")
        if only_model:
            out.append(f"group {group!r}: parameters only in the model: {_keys(only_model)}")
        for n in mine:
            if n in shapes and shapes[n] != mine[n]:
                out.append(f"shape mismatch for {n} (group {group!r}): {shapes[n]} in the checkpoint, "
                           f"{mine[n]} in the model")
        if not only_ck and not only_model and [n for n, _ in theirs] != [n for n, _ in params]:
            out.append(f"group {group!r}: the same parameters in another order")
    return out
