"""``ZeroConfig``: what the ZeRO++ layer quantizes and how, and the DeepSpeed mapping."""
from __future__ import annotations

import dataclasses
import warnings

import torch

from ..checks import check_bool, check_int
from ..comm.error_feedback import check_beta
from ..quant import format as fmt
from ..quant import outliers as reserve

_COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)

# DeepSpeed ``zero_optimization`` keys that qcoll understands; everything else is ignored (and named).
_DS_KNOWN = {"stage", "zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients",
             "stage3_param_persistence_threshold", "reduce_bucket_size"}
# keys that ask for something qcoll does not do, which a user would miss (memory): refused when
# enabled, unless from_deepspeed(..., ignore_unsupported=True)
_DS_OFFLOAD = ("offload_optimizer", "offload_param")
_DS_LEGACY_OFFLOAD = ("cpu_offload", "cpu_offload_params")
_ABSENT = object()


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
    ``hpz_partition_size``: the size of hpZ's secondary group that the config asks for
    (DeepSpeed's ``zero_hpz_partition_size``; needs ``hpz``); ``None``, the default, is the
    node. qcoll's secondary group is always the node: :meth:`check_topology` refuses any
    other size.

    ``reshard_after_backward``: ``False`` keeps every group's full weights gathered across the
    micro-batches of gradient accumulation (the forwards and backwards inside ``no_sync()`` and
    the step's last backward, which releases them), so each weight crosses the node links once
    per step instead of once per micro-batch, at the memory of the whole model's gathered
    weights (in the compute dtype) from the first micro-batch to the step's last backward (FSDP2's
    ``set_reshard_after_backward(False)``; ``memory_report(model)["gathered_peak"]`` shows it).
    Without ``no_sync()`` it changes nothing. Default True.

    ``broadcast_buffers``: rank 0's persistent buffers (BatchNorm's running statistics) are
    broadcast before the first forward after a training forward, so that every forward computes
    with the same ones on every rank (as DDP's ``broadcast_buffers``, default True;
    :mod:`qcoll.zero.buffers`). With False each rank keeps its own; ``state_dict()`` returns
    rank 0's either way.

    ``grad_error_feedback``: qgZ adds back what its codes failed to send of each group's gradient
    at the last reduction (:class:`qcoll.ErrorFeedback`, both hops), so 2-bit gradients do not
    drift. Each rank keeps, per group, fp32 residuals of the group's whole (unsharded) size plus
    ``nodes / world`` of it: a full fp32 gradient per rank, reported by ``memory_report``. Needs
    ``grad_bits``; not with ``grad_outliers`` or SimiGrad's similarity. Default False.
    ``grad_feedback_beta`` (0 to <1, default 0): the residual is a moving average of what the codes
    lost (LoCo; :class:`qcoll.ErrorFeedback`'s ``beta``): with Adam-family optimizers at 2 bits a
    full residual sends a block's small entries in bursts that Adam turns into large updates
    (bench/RESULTS.md measures it); DeepSpeed's LoCo default is 0.8.
    :func:`qcoll.zero.save` stores the residuals and :func:`qcoll.zero.load` restores them on the
    same world size and node count; on another layout they start at zero, with a warning.

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
    hpz_partition_size: int | None = None
    broadcast_buffers: bool = True
    reshard_after_backward: bool = True
    grad_error_feedback: bool = False
    grad_feedback_beta: float = 0.0

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
        for name in ("hpz", "stochastic_grad_rounding", "grad_hadamard", "hierarchical_gather", "broadcast_buffers",
                     "reshard_after_backward", "grad_error_feedback"):
            check_bool(getattr(self, name), name)
        if self.grad_error_feedback and (self.grad_bits is None or self.grad_outliers):
            raise ValueError(f"grad_error_feedback=True needs quantized gradients without an outlier reserve, got "
                             f"grad_bits={self.grad_bits}, grad_outliers={self.grad_outliers}")
        try:
            object.__setattr__(self, "grad_feedback_beta", check_beta(self.grad_feedback_beta))
        except (TypeError, ValueError) as e:
            raise type(e)(f"grad_feedback_{e}") from None
        if self.grad_feedback_beta and not self.grad_error_feedback:
            raise ValueError(f"grad_feedback_beta={self.grad_feedback_beta} needs grad_error_feedback=True")
        check_int(self.prefetch, "prefetch", minimum=0)
        check_int(self.persist_threshold, "persist_threshold", minimum=0)
        check_int(self.reduce_bucket_numel, "reduce_bucket_numel", minimum=0)
        if self.hpz_partition_size is not None:
            check_int(self.hpz_partition_size, "hpz_partition_size", minimum=1)
            if not self.hpz:
                raise ValueError(f"hpz_partition_size={self.hpz_partition_size} needs hpz=True "
                                 f"(it sizes hpZ's secondary group)")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"compute_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
                            f"got {self.compute_dtype!r}")

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype or torch.float32

    def check_topology(self, topology) -> None:
        """Raise ``ValueError`` when ``hpz_partition_size`` is set and is not ``topology.ranks_per_node``
        (qcoll's hpZ secondary group is the node); :func:`qcoll.zero.shard` calls it."""
        self._check_node(topology.ranks_per_node)

    def _check_node(self, ranks_per_node: int) -> None:
        size = self.hpz_partition_size
        if size is not None and size != ranks_per_node:
            raise ValueError(f"hpz_partition_size (DeepSpeed's zero_hpz_partition_size) is {size}, but a node "
                             f"has ranks_per_node={ranks_per_node} ranks; qcoll's hpZ secondary group is the "
                             f"node: set it to {ranks_per_node} (ranks_per_node) or drop it")

    @classmethod
    def zero3(cls, **overrides) -> "ZeroConfig":
        """Plain ZeRO-3: no quantization, no secondary shard."""
        return cls(**{"weight_bits": None, "hpz": False, "grad_bits": None, **overrides})

    @classmethod
    def from_deepspeed(cls, config: dict, ranks_per_node: int | None = None, *, ignore_unsupported: bool = False,
                       **overrides) -> "ZeroConfig":
        """Build from a DeepSpeed config (whole, or its ``zero_optimization`` section).

        ``stage`` must be 3. ``zero_quantized_weights`` -> 8-bit qwZ, ``zero_quantized_gradients``
        -> 4-bit qgZ; ``bf16.enabled`` (or DeepSpeed's older ``bfloat16.enabled``) ->
        ``compute_dtype=torch.bfloat16``, ``fp16.enabled`` -> ``torch.float16`` (both: a
        ``ValueError``, as in DeepSpeed). Booleans are ``True``/``False``, ``1``/``0`` (as DeepSpeed's
        pydantic config reads them) or ``"true"``/``"false"`` in any case; anything else (``"yes"``,
        ``1.5``, ``None``) is a ``ValueError`` naming the key and the value, never a truthiness.
        ``zero_hpz_partition_size > 1`` -> hpZ with ``hpz_partition_size`` set to it (qcoll's
        secondary group is the node: a size other than ``ranks_per_node`` is a ``ValueError`` here
        when ``ranks_per_node`` is given, else in :meth:`check_topology` when sharding);
        ``stage3_param_persistence_threshold`` -> ``persist_threshold``, ``reduce_bucket_size``
        -> ``reduce_bucket_numel``. The sizes are whole numbers, also as floats (``5e8``) or strings
        that parse as one (``"500000000"``, ``"5e8"``). ``"auto"`` (Hugging Face's placeholder) keeps
        qcoll's default with a warning naming the key: for ``zero_hpz_partition_size`` hpZ with the
        node as the group, for a boolean false (DeepSpeed drops ``"auto"`` keys). Keys qcoll does not
        implement (``fp16.loss_scale`` ...) are listed in one warning and otherwise ignored, except
        offloading: ``offload_optimizer`` / ``offload_param`` with a ``device`` other than ``"none"``
        (and the older ``cpu_offload`` / ``cpu_offload_params`` set true) are a ``ValueError`` naming
        the key, since qcoll keeps every state on the device and a run that asked for offload would
        silently need its memory; ``ignore_unsupported=True`` turns that into the warning.
        A top-level ``"qcoll"`` section (a whole config only; DeepSpeed leaves top-level keys it does
        not know alone) holds further :class:`ZeroConfig` fields, by name, that DeepSpeed has no key for
        (``{"weight_bits": 4, "grad_bits": [8, 4], "prefetch": 2, ...}``; ``compute_dtype`` as
        ``"float32"``, ``"bfloat16"``, ``"float16"`` or ``null``): they win over the DeepSpeed keys; a
        name that is not a field is a ``ValueError``. :func:`qcoll.tune.deepspeed_json` writes it.
        ``overrides`` are further :class:`ZeroConfig` fields and win over both.
        """
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict, got {type(config).__name__}")
        whole = "zero_optimization" in config
        section = config["zero_optimization"] if whole else config
        if not isinstance(section, dict):
            raise TypeError(f"zero_optimization must be a dict, got {type(section).__name__}")
        stage = section.get("stage", 0)
        if stage != 3:
            raise ValueError(f"qcoll implements ZeRO stage 3 only; zero_optimization.stage is {stage!r}")
        if ranks_per_node is not None:
            check_int(ranks_per_node, "ranks_per_node", minimum=1)
        bf16 = "bfloat16" if "bfloat16" in config and "bf16" not in config else "bf16"
        precision = {bf16: torch.bfloat16, "fp16": torch.float16} if whole else {}
        check_bool(ignore_unsupported, "ignore_unsupported")
        offload = _ds_offload(section)
        if offload and not ignore_unsupported:
            raise ValueError(f"qcoll does not offload to the CPU or NVMe; {', '.join(offload)} asks for it. qcoll "
                             f"keeps parameters, gradients and optimizer state on the device: remove the key (or set "
                             f"its device to \"none\"), or pass ignore_unsupported=True to train without offload")
        ignored = [f"zero_optimization.{k}" for k in sorted(set(section) - _DS_KNOWN)]
        enabled = []
        for key in sorted(config) if whole else []:
            if key not in precision:
                ignored += [key] if key not in ("zero_optimization", _QCOLL_SECTION) else []
                continue
            if not isinstance(config[key], dict):
                raise TypeError(f"{key} must be a dict, got {type(config[key]).__name__}")
            ignored += [f"{key}.{k}" for k in sorted(config[key]) if k != "enabled"]
            enabled += [key] if _ds_bool(config[key], "enabled", key) else []
        if ignored:
            warnings.warn(f"qcoll ZeroConfig.from_deepspeed ignores these DeepSpeed keys: {', '.join(ignored)}",
                          stacklevel=2)
        if len(enabled) > 1:
            raise ValueError(f"{enabled[0]}.enabled and {enabled[1]}.enabled are both true; DeepSpeed refuses "
                             f"that too: enable one of them")
        size = _ds_count(section, "zero_hpz_partition_size", "hpZ with the node as the group", minimum=1)
        fields = {
            "weight_bits": 8 if _ds_bool(section, "zero_quantized_weights", "zero_optimization") else None,
            "grad_bits": 4 if _ds_bool(section, "zero_quantized_gradients", "zero_optimization") else None,
            "hpz": size > 1 if size is not None else "zero_hpz_partition_size" in section,
        }
        if size is not None and size > 1:
            fields["hpz_partition_size"] = size
        if enabled:
            fields["compute_dtype"] = precision[enabled[0]]
        for key, name in (("stage3_param_persistence_threshold", "persist_threshold"),
                          ("reduce_bucket_size", "reduce_bucket_numel")):
            value = _ds_count(section, key, f"{name}={getattr(cls, name)}")
            if value is not None:
                fields[name] = value
        explicit = {**(_qcoll_section(config[_QCOLL_SECTION]) if whole and _QCOLL_SECTION in config else {}),
                    **overrides}
        fields.update(explicit)
        if fields["hpz"] is False and "hpz_partition_size" not in explicit:
            fields.pop("hpz_partition_size", None)
        result = cls(**fields)
        if ranks_per_node is not None:
            result._check_node(ranks_per_node)
        return result


_QCOLL_SECTION = "qcoll"   # a whole config's top-level section of further ZeroConfig fields (from_deepspeed)
_DTYPE_NAMES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _qcoll_section(section) -> dict:
    """The ``"qcoll"`` section's ZeroConfig fields (``compute_dtype`` from its name); ``ValueError`` naming
    a key that is not a field or a ``compute_dtype`` that is not one of the names."""
    if not isinstance(section, dict):
        raise TypeError(f"the DeepSpeed config's {_QCOLL_SECTION!r} section must be a dict of ZeroConfig fields, "
                        f"got {type(section).__name__}")
    names = [f.name for f in dataclasses.fields(ZeroConfig)]
    unknown = sorted(str(k) for k in section if k not in names)
    if unknown:
        raise ValueError(f"{_QCOLL_SECTION}.{unknown[0]:.80} is not a ZeroConfig field (the {_QCOLL_SECTION!r} "
                         f"section takes {', '.join(names)})")
    fields = dict(section)
    if "compute_dtype" in fields:
        name = fields["compute_dtype"]
        if not isinstance(name, (str, type(None))) or name not in _DTYPE_NAMES:
            raise ValueError(f"{_QCOLL_SECTION}.compute_dtype must be \"float32\", \"bfloat16\", \"float16\" or null, "
                             f"got {name!r:.80}")
        fields["compute_dtype"] = _DTYPE_NAMES[name]
    return fields


def _ds_offload(section: dict) -> list[str]:
    """The offload settings of ``section`` that ask for offloading (``key.device=...``, or an older ``key=true``)."""
    asked = []
    for key in _DS_OFFLOAD:
        value = section.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise TypeError(f"zero_optimization.{key} must be a dict, got {type(value).__name__}")
        device = value.get("device", "none")
        if device not in ("none", None):
            asked.append(f"zero_optimization.{key}.device={device!r}")
    for key in _DS_LEGACY_OFFLOAD:
        if key in section and _ds_bool(section, key, "zero_optimization"):
            asked.append(f"zero_optimization.{key}=true")
    return asked


def _ds_auto(path: str, default: str) -> None:
    warnings.warn(f"qcoll ZeroConfig.from_deepspeed: {path} is 'auto'; keeping qcoll's default, {default} "
                  f"(set a value to choose)", stacklevel=4)


def _ds_bool(section: dict, key: str, where: str) -> bool | None:
    """The DeepSpeed boolean ``where.key``: ``True``/``False``, ``1``/``0`` (pydantic's reading) or
    ``"true"``/``"false"`` in any case; ``None`` when absent or ``"auto"`` (a warning; DeepSpeed drops
    ``"auto"`` keys: false). Anything else, including the other spellings pydantic would take
    (``"yes"``, ``"on"``), is a ``ValueError`` naming the key and the value."""
    value = section.get(key, _ABSENT)
    if value is _ABSENT:
        return None
    if value == "auto":
        _ds_auto(f"{where}.{key}", "false")
        return None
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{where}.{key} must be true or false (a bool, 0 or 1, or the string 'true' or 'false'), "
                     f"got {value!r}")


def _ds_count(section: dict, key: str, auto: str, minimum: int = 0) -> int | None:
    """The DeepSpeed count ``zero_optimization.key``: a whole number ``>= minimum``, also as a float
    (``5e8``) or a string that parses as one (``"5e8"``, ``"500000000"``). ``None`` when absent or
    ``"auto"`` (Hugging Face's placeholder, filled from the model by its Trainer: qcoll keeps its
    default, named by ``auto`` in a warning). Anything else is a ``ValueError`` naming the key."""
    value = section.get(key, _ABSENT)
    if value is _ABSENT:
        return None
    if value == "auto":
        _ds_auto(f"zero_optimization.{key}", auto)
        return None
    number = value
    for parse in (int, float) if isinstance(value, str) else ():
        try:
            number = parse(value)
            break
        except ValueError:
            pass
    if isinstance(number, float) and number.is_integer():
        number = int(number)
    if isinstance(number, bool) or not isinstance(number, int) or number < minimum:
        raise ValueError(f"zero_optimization.{key} must be a whole number >= {minimum} or 'auto', got {value!r}")
    return number
