"""Any forward output gets its backward gathers, and the note about released parameters names
them only where a forward really read one.

Oracles: the unsharded model trained in one process (an output that is a plain object with a
``.loss``); the error text of reads the test makes on purpose, and of a failure the test injects
into the engine's gather (no read of a released parameter at all).
"""
import copy

import pytest
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.testing import Batches, check_parity, corpus, tiny_model
from qcoll.zero.flat import FlatGroup

BATCH = 8
CONTEXT = tiny_model(0).cfg.context


class Output:
    """What some libraries return: a plain object with tensor attributes (no pytree)."""

    def __init__(self, loss, logits):
        self.loss, self.logits = loss, logits


class SlotOutput:
    __slots__ = ("loss",)

    def __init__(self, loss):
        self.loss = loss


class Wrapped(nn.Module):
    def __init__(self, inner, kind):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x, y):
        loss = self.inner(x, y)
        return Output(loss, None) if self.kind == "plain" else SlotOutput(loss)


def _plain_object_output(rank, world):
    model = Wrapped(tiny_model(0), "plain")
    reference = copy.deepcopy(model)
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=list(model.inner.blocks))
    loss_fn = lambda m, x, y: m(x, y).loss  # noqa: E731
    check_parity(model, zero.Optimizer(model, torch.optim.SGD, lr=0.5), reference,
                 torch.optim.SGD(reference.parameters(), lr=0.5), Batches(corpus(), BATCH, CONTEXT, 3), 3, rank=rank,
                 world=world, rtol=2e-5, atol=2e-5, loss_rtol=1e-5, loss_fn=loss_fn)
    return True


def test_an_output_that_is_a_plain_object_trains_like_one_process(ranks4):
    assert all(ranks4.run(_plain_object_output, timeout=120))


def _slot_output(rank, world):
    model = Wrapped(tiny_model(0), "slots")
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=list(model.inner.blocks))
    x, y = Batches(corpus(), BATCH, CONTEXT, 3).next()
    with pytest.raises(TypeError, match=r"SlotOutput.*pytree"):
        model(x, y)
    return True


def test_an_output_hiding_its_tensors_is_refused_at_the_forward_naming_its_type(ranks4):
    assert all(ranks4.run(_slot_output, timeout=60))


class LateReader(nn.Module):
    """Reads a block's weight from the root, but only from its second forward on."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for b in self.blocks:
            x = b(x)
        # F.layer_norm's frame holds the (released) weight it was handed
        return nn.functional.layer_norm(x, (8, 8), self.blocks[0].weight) if self.calls > 1 else x


def _late_read(rank, world):
    model = zero.shard(LateReader(), qcoll.Topology(2), zero.ZeroConfig.zero3())
    x = torch.randn(2, 8)
    model(x)
    try:
        model(x)
    except RuntimeError as e:
        return "\n".join(getattr(e, "__notes__", []))
    return None


def test_a_read_of_a_released_parameter_is_named(ranks4):
    for notes in ranks4.run(_late_read, timeout=60):
        assert notes and "'blocks.0.weight'" in notes and "while released" in notes


def _gather_fails(rank, world, monkeypatch_target):
    model = zero.shard(tiny_model(0), qcoll.Topology(2), zero.ZeroConfig.zero3(), units=None)
    x, y = Batches(corpus(), BATCH, CONTEXT, 3).next()
    real = FlatGroup.wait_for_unshard

    def broken(self):
        real(self)
        if self.name == "blocks.1":  # as a peer's death surfaces: in the engine's wait for a gather
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")

    FlatGroup.wait_for_unshard = broken
    try:
        model(x, y)
    except RuntimeError as e:
        return str(e), "\n".join(getattr(e, "__notes__", []))
    finally:
        FlatGroup.wait_for_unshard = real
    return None


def test_a_transport_error_is_not_explained_as_a_released_read(ranks4):
    for message, notes in ranks4.run(_gather_fails, None, timeout=60):
        assert "Connection closed by peer" in message
        assert "released" not in notes
