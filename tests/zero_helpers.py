"""Models, data and the single-process oracle shared by the ZeRO++ tests."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from qcoll.bench.textdata import Batches, stdlib_bytes
from qcoll.bench.transformer import CharTransformer, TransformerConfig

TINY = TransformerConfig(context=32, d_model=64, n_layers=2, n_heads=2)
_DATA = None


def data() -> torch.Tensor:
    global _DATA
    if _DATA is None:
        _DATA = stdlib_bytes(1 << 20)
    return _DATA


def tiny_model(seed: int = 0, cfg: TransformerConfig = TINY) -> CharTransformer:
    torch.manual_seed(seed)
    return CharTransformer(cfg)


def global_loss(local_loss: torch.Tensor) -> float:
    """The mean over ranks of equal-size micro-batch losses = the global-batch loss."""
    t = local_loss.detach().double().clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def make_optimizer(kind: str):
    """(class, kwargs). SGD for exact comparisons: Adam turns fp32 rounding noise on
    parameters whose true gradient is zero (attention key biases) into lr-sized steps."""
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 3e-3}


def oracle_run(model, steps: int, batch: int, seed: int, kind: str = "sgd"):
    """Plain single-process training on the whole global batch: (losses, state dict, model)."""
    ref = copy.deepcopy(model)
    cls, kw = make_optimizer(kind)
    opt = cls(ref.parameters(), **kw)
    batches = Batches(data(), batch, ref.cfg.context, seed)
    losses = []
    for _ in range(steps):
        x, y = batches.next(0, 1)
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, ref.state_dict(), ref
