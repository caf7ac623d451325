"""ZeRO++ sharded data parallelism: ZeRO-3 with qwZ, hpZ and qgZ.

    qcoll.zero.shard(model, config=qcoll.zero.ZeroConfig())   # every rank; in place, returns model
    opt = qcoll.zero.Optimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
    qcoll.zero.save(path, model, opt) / qcoll.zero.load(path, model, opt)
    with model.generation_mode() as gen: model.generate(...)   # hpZ shards kept across tokens
    qcoll.zero.export_quantized(model, "model.safetensors")  # the weight-quantized model
    qcoll.zero.reconfigure(model, ZeroConfig(weight_bits=4))  # another wire format, between steps
"""
from .adaptive import AdaptiveBatch
from .config import ZeroConfig
from .entry import register_forward_method
from .export import export_quantized
from .generation import GenerationStats
from .memory import memory_report
from .model import ShardedModel, ZeroModule, shard
from .optimizer import LossScaler, Optimizer
from .reconfigure import reconfigure
from .state import ZeroState, state_of

__all__ = ["AdaptiveBatch", "export_quantized", "GenerationStats", "shard", "ZeroModule", "ShardedModel", "ZeroState", "state_of", "ZeroConfig", "Optimizer", "LossScaler", "save", "load", "memory_report",
           "register_forward_method", "reconfigure"]


def save(checkpoint_dir, model, optimizer=None, adaptive=None, autotune=None) -> None:
    """Save the sharded model (and optimizer, :class:`AdaptiveBatch` controller and
    :class:`qcoll.tune.AutoTune` state) with torch.distributed.checkpoint (collective). See
    :mod:`qcoll.zero.checkpoint` (imported on first use: DCP is slow to import)."""
    from .checkpoint import save as _save

    _save(checkpoint_dir, model, optimizer, adaptive, autotune)


def load(checkpoint_dir, model, optimizer=None, adaptive=None, autotune=None) -> None:
    """Load a checkpoint written by :func:`save`, with any world size (collective)."""
    from .checkpoint import load as _load

    _load(checkpoint_dir, model, optimizer, adaptive, autotune)
