"""Hugging Face ``Trainer`` with FSDP2 (Accelerate's ``fsdp_version: 2``) and qcoll's comms.

Configure the ``Trainer`` as for plain FSDP2 and add the callback::

    args = TrainingArguments(..., fsdp="full_shard",
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[QuantizeCommCallback(qcoll.Topology(ranks_per_node=8))])

The ``Trainer`` shards the model with ``fully_shard`` before training starts; the callback's
``on_train_begin`` then calls :func:`qcoll.fsdp.quantize_comm` on it, on every rank.
Accelerate's FSDP2 plugin takes ``reshard_after_forward`` as a bool, so hpZ (resharding
to the node after forward) cannot be asked of it: the callback defaults to ``hpz=False``,
and the backward all-gather crosses nodes again, quantized like the forward's.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ..fsdp import quantize_comm


class QuantizeCommCallback(TrainerCallback):
    """Calls ``quantize_comm(model, topology, hpz=hpz, **kwargs)`` when training begins.

    ``topology``: a ``qcoll.Topology`` (None: ``LOCAL_WORLD_SIZE``, as torchrun and
    ``accelerate launch`` set it). ``kwargs``: ``quantize_comm``'s (``weight_bits``,
    ``grad_bits``, blocks, ``timeout``). ``modules``: after training begins, the FSDP
    modules it configured. A model that is not sharded with FSDP2 by then (no
    ``fsdp_version: 2`` in the ``Trainer``'s config) is a ``ValueError`` from
    ``quantize_comm``: the training never runs unquantized by mistake.
    """

    def __init__(self, topology=None, *, hpz: bool = False, **kwargs):
        self.topology, self.hpz, self.kwargs = topology, hpz, kwargs
        self.modules = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("QuantizeCommCallback: the Trainer passed no model to on_train_begin")
        self.modules = quantize_comm(model, self.topology, hpz=self.hpz, **self.kwargs)
        return control
