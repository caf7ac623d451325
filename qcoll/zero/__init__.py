"""ZeRO++ sharded data parallelism: ZeRO-3 with qwZ, hpZ and qgZ.

    model = qcoll.zero.shard(model, config=qcoll.zero.ZeroConfig())   # every rank
    opt = qcoll.zero.Optimizer(model, torch.optim.AdamW, lr=1e-3)
    loss = model(x).loss; loss.backward(); opt.step(); opt.zero_grad()
    qcoll.zero.save(path, model, opt) / qcoll.zero.load(path, model, opt)
"""
from .checkpoint import load, save
from .config import ZeroConfig
from .model import ShardedModel, shard
from .optimizer import LossScaler, Optimizer

__all__ = ["shard", "ShardedModel", "ZeroConfig", "Optimizer", "LossScaler", "save", "load"]
