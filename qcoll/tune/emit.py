"""A chosen configuration in the forms a user can take as printed (issue 43).

A configuration is a :class:`~qcoll.zero.ZeroConfig`, or a dict of its fields (a point of a
:class:`~qcoll.tune.Space`: ``space.config(point)``, which means ``ZeroConfig(**config)``). Its forms:

- :func:`zero_config_line`: ``ZeroConfig(...)`` source that ``eval`` (with ``ZeroConfig`` and
  ``torch`` in scope) turns into an equal ZeroConfig;
- :func:`deepspeed_json`: a DeepSpeed config, JSON-able (``json.dumps`` as is): its
  ``zero_optimization`` section holds DeepSpeed's own keys only, with real numbers (the hpZ group
  is ``ranks_per_node``), so DeepSpeed's schema (pydantic, unknown keys refused) takes it;
  ``bf16`` / ``fp16`` ``{"enabled": true}`` carry a bf16 / fp16 ``compute_dtype``; a top-level
  ``"qcoll"`` section (which DeepSpeed, reading its top-level keys by name, leaves alone) holds
  the ZeroConfig fields DeepSpeed's keys do not give (4-bit weights, 8-bit or per-hop gradients,
  prefetch, block sizes, ...; left out when there are none). ``ZeroConfig.from_deepspeed(doc,
  ranks_per_node)`` reads both and gives back the configuration, field by field, without a warning;
- :func:`quantize_comm_kwargs` / :func:`quantize_comm_line`: the FSDP2 path, the keyword arguments of
  :func:`qcoll.fsdp.quantize_comm` and the fields it has no argument for;
- :func:`config_lines`: the lines ``qcoll-bench tune`` and ``train --auto`` print (the JSON alone on
  its line); :func:`write_config`: the JSON written atomically (``--emit-config FILE``).
"""
from __future__ import annotations

import dataclasses
import json
import warnings

import torch

from ..files import write_atomic
from ..zero.config import ZeroConfig

#: ``compute_dtype`` in the ``"qcoll"`` section (JSON has no dtype): the names ``from_deepspeed`` reads
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
#: the DeepSpeed top-level sections a bf16 / fp16 ``compute_dtype`` is written as
_PRECISION_SECTIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
#: ZeroConfig field -> ``quantize_comm`` keyword
QUANTIZE_COMM_ARGS = {"weight_bits": "weight_bits", "grad_bits": "grad_bits", "weight_block": "weight_block",
                      "grad_block": "grad_block", "hpz": "hpz", "grad_hadamard": "hadamard",
                      "grad_error_feedback": "error_feedback", "grad_feedback_beta": "feedback_beta"}
#: ZeroConfig fields FSDP2 sets itself, not ``quantize_comm``: where
_FSDP2_SETS = {"compute_dtype": "MixedPrecisionPolicy(param_dtype=...)",
               "reshard_after_backward": "FSDPModule.set_reshard_after_backward",
               "prefetch": "FSDPModule.set_modules_to_forward_prefetch"}
_DEFAULT = ZeroConfig()


def zero_config(config) -> ZeroConfig:
    """``config`` as a :class:`ZeroConfig`: itself, or ``ZeroConfig(**config)`` for a dict of its fields
    (``TypeError`` naming what else it got)."""
    if isinstance(config, ZeroConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"a configuration is a ZeroConfig or a dict of its fields, got {type(config).__name__}")
    return ZeroConfig(**config)


def _py(value) -> str:
    return f"torch.{DTYPE_NAMES[value]}" if isinstance(value, torch.dtype) else repr(value)


def zero_config_line(config) -> str:
    """``ZeroConfig(...)`` source: a dict's fields as given (in its order), a ZeroConfig's fields that
    differ from the defaults (in field order). ``eval`` of it, with ``ZeroConfig`` and ``torch`` in
    scope, equals ``zero_config(config)``."""
    cfg = zero_config(config)   # never prints what does not construct
    if isinstance(config, dict):
        fields = config
    else:
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
                  if getattr(cfg, f.name) != getattr(_DEFAULT, f.name)}
    return "ZeroConfig(" + ", ".join(f"{k}={_py(v)}" for k, v in fields.items()) + ")"


def _json_value(value):
    if isinstance(value, torch.dtype):
        return DTYPE_NAMES[value]
    return list(value) if isinstance(value, tuple) else value


def deepspeed_json(config, ranks_per_node: int | None = None) -> dict:
    """The configuration as a DeepSpeed config (module docstring): ``{"zero_optimization": {...}}``, with
    ``"bf16"`` / ``"fp16"`` and ``"qcoll"`` where needed. ``zero_optimization`` always holds ``stage`` (3),
    ``zero_quantized_weights`` (8-bit weights), ``zero_quantized_gradients`` (4-bit gradients),
    ``zero_hpz_partition_size`` (``ranks_per_node`` with hpZ, else 1), ``stage3_param_persistence_threshold``
    and ``reduce_bucket_size``. ``ranks_per_node`` (the run's): needed with hpZ, whose secondary group is the
    node (a ``ValueError`` without it, or when the config's ``hpz_partition_size`` is another size)."""
    cfg = zero_config(config)
    if ranks_per_node is not None:
        cfg._check_node(ranks_per_node)
    if not cfg.hpz:
        size = 1
    else:
        size = cfg.hpz_partition_size or ranks_per_node
        if size is None:
            raise ValueError("deepspeed_json: hpZ's secondary group is the node: pass ranks_per_node (the run's ranks "
                             "per node), the number DeepSpeed's zero_hpz_partition_size takes")
    doc = {"zero_optimization": {"stage": 3, "zero_quantized_weights": cfg.weight_bits == 8,
                                 "zero_quantized_gradients": cfg.grad_bits == 4, "zero_hpz_partition_size": size,
                                 "stage3_param_persistence_threshold": cfg.persist_threshold,
                                 "reduce_bucket_size": cfg.reduce_bucket_numel}}
    if cfg.compute_dtype in _PRECISION_SECTIONS:
        doc[_PRECISION_SECTIONS[cfg.compute_dtype]] = {"enabled": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # nothing here is ignored nor "auto"
        read = ZeroConfig.from_deepspeed(doc, ranks_per_node)
    rest = {f.name: _json_value(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
            if getattr(read, f.name) != getattr(cfg, f.name)}
    if rest:
        doc["qcoll"] = rest
    return doc


def quantize_comm_kwargs(config) -> tuple[dict, dict]:
    """``(kwargs, left)``: the keyword arguments of :func:`qcoll.fsdp.quantize_comm` for the configuration
    (every one of its eight: ``weight_bits``, ``grad_bits``, ``weight_block``, ``grad_block``, ``hpz``,
    ``hadamard`` from ``grad_hadamard``, ``error_feedback`` and ``feedback_beta`` from ``grad_error_feedback``
    and ``grad_feedback_beta``), and ``{field: value}`` of the configuration's fields that differ
    from ZeroConfig's defaults and have no ``quantize_comm`` argument (FSDP2's own settings or nothing)."""
    cfg = zero_config(config)
    kwargs = {arg: getattr(cfg, field) for field, arg in QUANTIZE_COMM_ARGS.items()}
    left = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in QUANTIZE_COMM_ARGS and getattr(cfg, f.name) != getattr(_DEFAULT, f.name)}
    return kwargs, left


def quantize_comm_line(config) -> str:
    """``quantize_comm(model, topology, weight_bits=..., ...)`` source (:func:`quantize_comm_kwargs`)."""
    kwargs, _ = quantize_comm_kwargs(config)
    return "quantize_comm(model, topology, " + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


def quantize_comm_note(config, ranks_per_node: int | None = None) -> str:
    """What the FSDP2 path needs beside :func:`quantize_comm_line` and what it leaves out, in words ('' if
    nothing)."""
    cfg = zero_config(config)
    _, left = quantize_comm_kwargs(cfg)
    notes = []
    if cfg.hpz:   # (hpz_partition_size, when set, is that size: said here)
        size = cfg.hpz_partition_size or ranks_per_node or "<ranks per node>"
        notes.append(f"hpz=True needs fully_shard(block, reshard_after_forward={size}) on every block")
    left.pop("hpz_partition_size", None)
    fsdp = [f"{k}={_py(v)} ({_FSDP2_SETS[k]})" for k, v in left.items() if k in _FSDP2_SETS]
    none = [f"{k}={_py(v)}" for k, v in left.items() if k not in _FSDP2_SETS]
    if fsdp:
        notes.append("set in FSDP2: " + ", ".join(fsdp))
    if none:
        notes.append("no FSDP2 equivalent, left out: " + ", ".join(none))
    return "; ".join(notes)


def config_lines(config, ranks_per_node: int | None = None, indent: str = "") -> list[str]:
    """The printed forms: the ``ZeroConfig(...)`` line, a title line then the DeepSpeed JSON alone on its
    line (``json.loads`` takes the line as is), and the ``quantize_comm(...)`` line with its note."""
    lines = [f"{indent}ZeroConfig: {zero_config_line(config)}",
             f"{indent}DeepSpeed config (JSON; the \"qcoll\" section: what DeepSpeed has no key for, read by "
             f"ZeroConfig.from_deepspeed):",
             indent + json.dumps(deepspeed_json(config, ranks_per_node)),
             f"{indent}FSDP2: {quantize_comm_line(config)}"]
    note = quantize_comm_note(config, ranks_per_node)
    if note:
        lines.append(f"{indent}  ({note})")
    return lines


def write_config(path: str, config, ranks_per_node: int | None = None) -> None:
    """:func:`deepspeed_json` written to ``path`` as indented JSON, atomically
    (:func:`qcoll.files.write_atomic`: never half a file; a symlink at ``path`` is replaced, not followed)."""
    text = json.dumps(deepspeed_json(config, ranks_per_node), indent=2) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))
