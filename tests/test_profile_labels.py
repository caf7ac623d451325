"""A user's profile names each collective and each ZeRO phase (``record_function`` labels, as FSDP2's)."""
import torch
from torch import nn

import qcoll
from qcoll import zero

COLLECTIVES = ["qcoll::qwZ", "qcoll::qwZ::wait", "qcoll::hpZ", "qcoll::hpZ::wait", "qcoll::qgZ",
               "qcoll::qgZ::wait"]
PHASES = ["qcoll.zero::pre_forward", "qcoll.zero::post_forward", "qcoll.zero::end_forward",
          "qcoll.zero::pre_backward", "qcoll.zero::reduce_grads", "qcoll.zero::post_backward"]


def _profiled_step(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(weight_bits=8, hpz=True, grad_bits=4, weight_block=32),
               units=[model[0], model[2]])
    x = torch.randn(3, 16)
    model(x).square().sum().backward()  # the first step runs the probe; profile the second
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).square().sum().backward()
    return sorted({e.name for e in prof.events() if e.name.startswith("qcoll")})


def test_profile_shows_collectives_and_zero_phases(ranks4):
    for names in ranks4.run(_profiled_step, timeout=120):
        missing = [label for label in COLLECTIVES + PHASES if label not in names]
        assert not missing, (missing, names)
