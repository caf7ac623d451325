"""Hugging Face ``Trainer`` on an FSDP2 (or HSDP) model, with qcoll's comms: one callback.

Two ways to hand the ``Trainer`` an FSDP2 model, both taking the same callback::

    # GPUs: Accelerate's FSDP2 plugin shards the model when the Trainer prepares it
    args = TrainingArguments(..., fsdp=True,
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[QuantizeCommCallback()])

    # any device (CPU included): Transformers shards the model when it loads it
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=world))
    # (HSDP, weights never cross nodes: DistributedConfig(fsdp_size=ranks_per_node, dp_replicate_size=nodes))
    trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data, callbacks=[QuantizeCommCallback()])

Either way the model is sharded with ``fully_shard`` before training begins, and the
callback's ``on_train_begin`` calls :func:`qcoll.fsdp.quantize_comm` on it, on every rank.

What Transformers 5.25 / Accelerate 1.16 do, and why the callback defaults to ``hpz=False``:

- On CPU, Accelerate leaves ``fsdp_config`` off without a word: its ``AcceleratorState`` turns
  FSDP on only for accelerator backends, so ``use_cpu=True`` runs ``MULTI_CPU`` (DDP) on the
  whole model. The callback then raises (naming that distributed type) rather than train with
  uncompressed comms; load the model with a ``DistributedConfig`` instead (second recipe).
- hpZ wants ``reshard_after_forward=<ranks per node>`` on the blocks; Accelerate's FSDP2 plugin
  takes a bool only (``fsdp_config={"reshard_after_forward": 2}`` is ``ValueError: invalid
  truth value 2`` from ``TrainingArguments``; the plugin itself says ``reshard_after_forward
  set to 2. This is not supported with FSDP2, please set to a `bool```), and Transformers'
  ``DistributedConfig`` reshards the blocks with ``True``. So the backward all-gather crosses
  nodes again, quantized like the forward's (``hpz=False``). On HSDP ``hpz`` plays no part.
"""
from __future__ import annotations

from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from ..fsdp import quantize_comm


class QuantizeCommCallback(TrainerCallback):
    """Calls ``quantize_comm(model, topology, hpz=hpz, **kwargs)`` when training begins.

    ``topology``: a ``qcoll.Topology`` (None: the HSDP mesh's, else ``LOCAL_WORLD_SIZE``,
    as torchrun and ``accelerate launch`` set it). ``hpz``: see the module's notes (the
    ``Trainer``'s sharding reshards the blocks to the world after forward, which is
    ``hpz=False``). ``kwargs``: ``quantize_comm``'s (``weight_bits``, ``grad_bits``,
    blocks, ``timeout``). ``modules``: once training began, the FSDP modules configured.

    A model that reaches training without FSDP2 modules is a ``ValueError`` (naming
    Accelerate's distributed type): the training never runs unquantized by mistake.
    """

    def __init__(self, topology=None, *, hpz: bool = False, **kwargs):
        self.topology, self.hpz, self.kwargs = topology, hpz, kwargs
        self.modules = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        """Quantize the comms of the (by now sharded) ``model``, on every rank."""
        if model is None:
            raise ValueError("QuantizeCommCallback: the Trainer passed no model to on_train_begin")
        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise ValueError(
                f"QuantizeCommCallback: {type(model).__name__} reached training without FSDP2 modules (Accelerate's "
                f"distributed type: {_accelerate_type()}, TrainingArguments.fsdp={args.fsdp!r}): Accelerate shards "
                f"with FSDP2 on accelerators only and leaves fsdp_config off on CPU; load the model with "
                f"from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=...)) instead")
        self.modules = quantize_comm(model, self.topology, hpz=self.hpz, **self.kwargs)
        return control


def _accelerate_type() -> str:
    """Accelerate's ``distributed_type`` (``MULTI_CPU``, ``FSDP``, ...) once the Trainer set it up."""
    from accelerate.state import AcceleratorState, is_initialized

    return AcceleratorState().distributed_type.value if is_initialized() else "not initialized"
