"""The ZeRO tests' choice of optimizer (models, data and the training loop: ``qcoll.testing``)."""
from __future__ import annotations

import torch


def make_optimizer(kind: str):
    """(class, kwargs). SGD for exact comparisons: Adam turns fp32 rounding noise on
    parameters whose true gradient is zero (attention key biases) into lr-sized steps."""
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 3e-3}
