"""``ZeroConfig``: what the ZeRO++ layer quantizes and how, and the DeepSpeed mapping."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..checks import check_bool, check_int
from ..quant import format as fmt
from ..quant import outliers as reserve

_COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)

# DeepSpeed ``zero_optimization`` keys that qcoll understands; everything else is ignored (and named).
_DS_KNOWN = {"stage", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients",
             "stage3_param_persistence_threshold", "reduce_bucket_size"}


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
    """Configuration of :func:`qcoll.zero.shard`.

    ``weight_bits``: qwZ bits of the forward (and, without hpZ, backward) weight
    all-gather, ``None`` for the unquantized gather. ``hpz``: keep a node-local
    secondary shard so the backward gather stays inside the node. ``grad_bits``:
    qgZ bits of the gradient reduce-scatter, ``None`` for ``reduce_scatter_tensor``, or a
    pair ``(intra, inter)``: each hop's width (e.g. ``(8, 4)``: 8-bit inside the node,
    4-bit across nodes, as SDP4Bit).
    ``weight_block`` / ``grad_block``: quantization block sizes.
    ``grad_hadamard``: rotate each gradient block with the orthonormal Walsh-Hadamard
    matrix before qgZ quantizes it (spreads outliers; docs/FORMAT.md "Rotation").
    ``weight_outliers`` / ``grad_outliers``: keep each block's ``k`` largest-magnitude
    values exactly beside the codes (docs/FORMAT.md "Outlier reserve"; 0 to 8, 0 off).
    ``stochastic_grad_rounding``: stochastic rounding of gradients (seeded by the
    step, the unit and the rank: reproducible). ``prefetch``: how many units ahead
    to gather asynchronously (0 disables). ``compute_dtype``: dtype of the gathered
    parameters and the forward/backward (``None``: fp32); master weights and
    optimizer state are always fp32. ``persist_threshold``: parameters of fewer elements
    stay whole on every rank, never gathered, their gradients averaged by one all-reduce
    per backward (DeepSpeed's ``stage3_param_persistence_threshold``; 0 shards everything).
    ``hierarchical_gather``: the forward gathers (and without hpZ the backward's) run node
    by node, across nodes among ranks of equal local index and then inside the node
    (``all_gather_quantized(topology=...)``): each shard crosses the node links once per
    other node instead of a ring's ``W - 1`` times through its links between nodes.
    Same values; ``False`` is the one all-gather over the world that DeepSpeed and FSDP run.
    ``reduce_bucket_numel``: coalesce the gradient reductions of groups that finish their
    backward one after another into one reduce-scatter, launched once the groups waiting hold
    at least this many gradient elements (whole, unsharded; the rest at the end of the
    backward): fewer, larger collectives for many small units, at the price of starting the
    first ones later (DeepSpeed's ``reduce_bucket_size``; 0, the default, reduces each group
    as soon as its gradients are ready). Each group's slice starts at a gradient block, so
    coalescing does not change the values (with deterministic rounding, without rotation).

    ``ZeroConfig(weight_bits=None, hpz=False, grad_bits=None)`` is plain ZeRO-3.
    """

    weight_bits: int | None = 8
    hpz: bool = True
    grad_bits: int | tuple[int, int] | None = 4
    weight_block: int = fmt.DEFAULT_WEIGHT_BLOCK
    grad_block: int = fmt.DEFAULT_GRAD_BLOCK
    stochastic_grad_rounding: bool = False
    grad_hadamard: bool = False
    weight_outliers: int = 0
    grad_outliers: int = 0
    prefetch: int = 1
    compute_dtype: torch.dtype | None = None
    persist_threshold: int = 0
    hierarchical_gather: bool = True
    reduce_bucket_numel: int = 0

    def __post_init__(self):
        if self.weight_bits is not None:
            fmt.check_bits(self.weight_bits, "weight_bits")
        if isinstance(self.grad_bits, (tuple, list)):
            if len(self.grad_bits) != 2:
                raise ValueError(f"grad_bits must be an int, None or a pair (intra-node bits, inter-node bits), "
                                 f"got {self.grad_bits!r}")
            pair = (fmt.check_bits(self.grad_bits[0], "grad_bits[0] (intra-node)"),
                    fmt.check_bits(self.grad_bits[1], "grad_bits[1] (inter-node)"))
            object.__setattr__(self, "grad_bits", pair)
        elif self.grad_bits is not None:
            fmt.check_bits(self.grad_bits, "grad_bits")
        for name, bits, block in (("weight_outliers", self.weight_bits, self.weight_block),
                                  ("grad_outliers", self.grad_bits, self.grad_block)):
            if reserve.check_outliers(getattr(self, name), block, name) and bits is None:
                raise ValueError(f"{name}={getattr(self, name)} needs quantization ({name[:-9]}_bits is None)")
        if self.grad_hadamard and self.grad_bits is None:
            raise ValueError("grad_hadamard=True needs quantized gradients (grad_bits is None)")
        fmt.check_block_size(self.weight_block, "weight_block")
        fmt.check_block_size(self.grad_block, "grad_block")
        for name in ("hpz", "stochastic_grad_rounding", "grad_hadamard", "hierarchical_gather"):
            check_bool(getattr(self, name), name)
        check_int(self.prefetch, "prefetch", minimum=0)
        check_int(self.persist_threshold, "persist_threshold", minimum=0)
        check_int(self.reduce_bucket_numel, "reduce_bucket_numel", minimum=0)
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"compute_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                            f"got {self.compute_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype or torch.float32

    @classmethod
    def zero3(cls, **overrides) -> "ZeroConfig":
        """Plain ZeRO-3: no quantization, no secondary shard."""
        return cls(**{"weight_bits": None, "hpz": False, "grad_bits": None, **overrides})

    @classmethod
    def from_deepspeed(cls, config: dict, ranks_per_node: int | None = None, **overrides) -> "ZeroConfig":
        """Build from a DeepSpeed config (whole, or its ``zero_optimization`` section).

        ``stage`` must be 3. ``zero_quantized_weights`` -> 8-bit qwZ,
        ``zero_quantized_gradients`` -> 4-bit qgZ, ``zero_hpz_partition_size > 1``
        -> hpZ with the node (``ranks_per_node``) as the secondary group,
        ``stage3_param_persistence_threshold`` -> ``persist_threshold``,
        ``reduce_bucket_size`` (when given) -> ``reduce_bucket_numel``; a size
        other than ``ranks_per_node`` gets a warning naming both. Keys qcoll does
        not implement are listed in one warning and otherwise ignored.
        ``overrides`` are further :class:`ZeroConfig` fields.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        section = config.get("zero_optimization", config)
        if not isinstance(section, dict):
            raise TypeError(f"zero_optimization must be a dict, got {type(section).__name__}")
        stage = section.get("stage", 0)
        if stage != 3:
            raise ValueError(f"qcoll implements ZeRO stage 3 only; zero_optimization.stage is {stage!r}")
        ignored = sorted(set(section) - _DS_KNOWN)
        ignored_top = sorted(k for k in config if k != "zero_optimization") if section is not config else []
        if ignored or ignored_top:
            names = ", ".join([f"zero_optimization.{k}" for k in ignored] + ignored_top)
            warnings.warn(f"qcoll ZeroConfig.from_deepspeed ignores these DeepSpeed keys: {names}", stacklevel=2)
        hpz_size = section.get("zero_hpz_partition_size", 1)
        check_int(hpz_size, "zero_hpz_partition_size", minimum=1)
        if hpz_size > 1 and ranks_per_node is not None and hpz_size != ranks_per_node:
            warnings.warn(f"zero_hpz_partition_size={hpz_size} differs from ranks_per_node={ranks_per_node}; "
                          f"qcoll uses the node ({ranks_per_node} ranks) as the hpZ secondary group", stacklevel=2)
        fields = {
            "weight_bits": 8 if section.get("zero_quantized_weights", False) else None,
            "grad_bits": 4 if section.get("zero_quantized_gradients", False) else None,
            "hpz": hpz_size > 1,
        }
        for key, name in (("stage3_param_persistence_threshold", "persist_threshold"),
                          ("reduce_bucket_size", "reduce_bucket_numel")):
            value = _ds_count(section, key)
            if value is not None:
                fields[name] = value
        fields.update(overrides)
        return cls(**fields)


def _ds_count(section: dict, key: str) -> int | None:
    """A DeepSpeed element count (``5e8`` or ``500000000``); None when absent or ``"auto"``
    (Hugging Face's placeholder, filled from the model by its Trainer: qcoll keeps its default)."""
    value = section.get(key)
    if value is None:
        return None
    if value == "auto":
        warnings.warn(f"qcoll ZeroConfig.from_deepspeed: zero_optimization.{key} is 'auto'; using qcoll's "
                      f"default (set a number to choose)", stacklevel=3)
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"zero_optimization.{key} must be a non-negative whole number of elements or 'auto', "
                         f"got {value!r}")
    return int(value)
