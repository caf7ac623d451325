"""Convert a checkpoint of qcoll's earlier format (the optimizer's hyper-parameters as pickles) into
the current one: :func:`upgrade_checkpoint` (also importable from :mod:`qcoll.zero.checkpoint_safety`).

It reads the checkpoint whole into memory, so before allocating anything it bounds every size the
metadata claims by the data files' lengths on disk (:func:`check_data_files`, on top of
:func:`~qcoll.zero.checkpoint_safety.read_metadata`'s checks): a crafted ``.metadata`` claiming a
tensor of 2**40 elements is a ValueError naming the file and the entry, not a 4 TiB allocation.
The pickled entries are read with ``torch.load(weights_only=True)``: nothing in them runs.
"""
from __future__ import annotations

import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from . import atomic_dir
from .checkpoint_safety import (_LEGACY_KEY, SafeReader, UnsafeCheckpointError, encode_param_groups, read_metadata,
                                summarize)


def check_data_files(checkpoint_dir, md: Metadata) -> None:
    """Every data location of ``md`` (checked by ``read_metadata``: each tensor chunk fits its
    location's length) lies inside its file in ``checkpoint_dir``, and the lengths recorded in a file
    add up to no more than its size: then no size the metadata claims exceeds what the files hold.
    ValueError naming the file and the entry otherwise; FileNotFoundError for a missing file."""
    sizes: dict[str, int] = {}
    used: dict[str, int] = {}
    for index, info in md.storage_data.items():
        path = os.path.join(os.fspath(checkpoint_dir), info.relative_path)
        if path not in sizes:
            sizes[path] = os.path.getsize(path)
        used[path] = used.get(path, 0) + info.length
        if info.offset + info.length > sizes[path] or used[path] > sizes[path]:
            where = f"at bytes {info.offset}..{info.offset + info.length} of it" if used[path] <= sizes[path] else \
                f"with {info.length} bytes, which makes {used[path]} bytes recorded in it"
            raise ValueError(f"checkpoint file {path!r} has {sizes[path]} bytes, but the metadata records entry "
                             f"{index.fqn!r} {where} (a crafted or damaged checkpoint): refusing to allocate it")


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """Reads ``BYTE_IO`` entries with ``torch.load(weights_only=True)``: plain data only, no code."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item, value) -> None:
        key = read_item.dest_index.fqn
        try:
            self.original_state_dict[key] = torch.load(value, weights_only=True)  # the caller's dict
        except pickle.UnpicklingError as e:
            why = [line for line in str(e).splitlines() if "GLOBAL" in line] or [str(e).splitlines()[0]]
            raise UnsafeCheckpointError(f"{key!r} is refused by torch.load(weights_only=True): {why[0].strip()}") from e


def upgrade_checkpoint(src, dst=None) -> None:
    """Convert a checkpoint that an earlier qcoll wrote (the optimizer's hyper-parameters pickled as
    ``optim.param_groups.<i>.<name>`` entries) into the current format, in ``dst`` (default: ``src``
    itself, replaced atomically as :func:`qcoll.zero.save` does).

    One process, no ``torch.distributed`` needed; the whole checkpoint is held in memory once, each
    size bounded first by the data files' lengths (:func:`check_data_files`: a ValueError naming the
    file and the entry). The pickled entries are read with ``torch.load(weights_only=True)`` (plain
    numbers, strings, tuples: a crafted entry is refused, nothing runs); any other non-tensor entry
    is refused. ValueError when ``src`` is already in the current format. A failed write (a full
    disk) is a ``CheckpointOSError`` naming the file, ``dst`` left as it was."""
    src = atomic_dir.checkpoint_path(src)
    dst = src if dst is None else atomic_dir.checkpoint_path(dst)
    md = read_metadata(src, allow_bytes=True)
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and not _LEGACY_KEY.fullmatch(key):
            raise UnsafeCheckpointError(f"{src}: non-tensor entry {key!r} is not one qcoll ever wrote; refusing")
    legacy = [k for k in md.state_dict_metadata if _LEGACY_KEY.fullmatch(k)]  # pickled, or a tensor lr as a tensor
    if not any(isinstance(md.state_dict_metadata[k], BytesStorageMetadata) for k in legacy):
        raise ValueError(f"{src}: already in the current format (no pickled optimizer hyper-parameters)")
    check_data_files(src, md)
    state = {key: None if isinstance(entry, BytesStorageMetadata) else torch.empty(entry.size,
                                                                                   dtype=entry.properties.dtype)
             for key, entry in md.state_dict_metadata.items()}
    try:
        with warnings.catch_warnings():  # DCP warns that it loads in one process, even when asked to
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=SafeReader(src, md), planner=_WeightsOnlyPlanner(), no_dist=True)
    except CheckpointException as e:
        raise summarize(e, "qcoll.zero.checkpoint_safety.upgrade_checkpoint") from e
    groups: dict[int, dict] = {}
    for key in legacy:
        _, _, index, name = key.split(".", 3)
        groups.setdefault(int(index), {})[name] = state.pop(key)
    if sorted(groups) != list(range(len(groups))):
        raise ValueError(f"{src}: the pickled param_groups are not numbered 0..{len(groups) - 1}: {sorted(groups)}")
    state["optim.param_groups"] = encode_param_groups([groups[i] for i in range(len(groups))])
    tmp = atomic_dir.prepare_save(dst)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            try:
                dcp.save(state, storage_writer=atomic_dir.writer(tmp), no_dist=True)
            except CheckpointException as e:
                raise summarize(e, "qcoll.zero.checkpoint_safety.upgrade_checkpoint") from e
        superseded = atomic_dir.install(tmp, dst)
    except BaseException:
        atomic_dir.discard(tmp)
        raise
    if superseded is not None:
        atomic_dir.discard(superseded)
