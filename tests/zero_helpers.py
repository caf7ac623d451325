"""Models, data and the single-process oracle shared by the ZeRO++ tests."""
from __future__ import annotations

import copy

import torch

from qcoll.testing import TINY, Batches, global_loss, tiny_model  # noqa: F401  (moved to qcoll.testing)
from qcoll.testing import corpus as data  # noqa: F401


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
