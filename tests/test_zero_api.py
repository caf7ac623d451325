"""ZeroConfig, the DeepSpeed mapping and misuse errors of qcoll.zero."""
import warnings

import pytest
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.testing import tiny_model


def test_defaults_are_zeropp():
    c = zero.ZeroConfig()
    assert (c.weight_bits, c.hpz, c.grad_bits, c.weight_block, c.grad_block) == (8, True, 4, 256, 128)
    assert zero.ZeroConfig.zero3() == zero.ZeroConfig(weight_bits=None, hpz=False, grad_bits=None)
    assert zero.ZeroConfig(grad_bits=[8, 4]).grad_bits == (8, 4)  # per-hop widths, stored as a tuple


@pytest.mark.parametrize("kwargs,exc,word", [
    ({"weight_bits": 3}, ValueError, "weight_bits"),
    ({"grad_bits": "4"}, TypeError, "grad_bits"),
    ({"grad_bits": (8,)}, ValueError, "pair"),
    ({"grad_hadamard": 1}, TypeError, "grad_hadamard"),
    ({"grad_hadamard": True, "grad_bits": None}, ValueError, "grad_hadamard"),
    ({"grad_bits": (8, 5)}, ValueError, r"grad_bits\[1\] \(inter-node\)"),
    ({"weight_block": 100}, ValueError, "weight_block"),
    ({"grad_block": 8192}, ValueError, "grad_block"),
    ({"hpz": 1}, TypeError, "hpz"),
    ({"prefetch": -1}, ValueError, "prefetch"),
    ({"compute_dtype": torch.int8}, TypeError, "compute_dtype"),
])
def test_bad_config_names_the_argument(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        zero.ZeroConfig(**kwargs)


def test_from_deepspeed_maps_the_zeropp_keys():
    ds = {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2,
        "zero_quantized_gradients": True, "overlap_comm": True}}
    with pytest.warns(UserWarning, match=r"zero_optimization\.overlap_comm.*train_batch_size"):
        c = zero.ZeroConfig.from_deepspeed(ds, ranks_per_node=2)
    assert (c.weight_bits, c.hpz, c.grad_bits) == (8, True, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = zero.ZeroConfig.from_deepspeed({"stage": 3})
    assert plain == zero.ZeroConfig.zero3()


def test_from_deepspeed_hpz_size_mismatch_is_an_error_with_both_numbers():
    with pytest.raises(ValueError, match=r"zero_hpz_partition_size\) is 8, .*ranks_per_node=2"):
        zero.ZeroConfig.from_deepspeed({"stage": 3, "zero_hpz_partition_size": 8}, ranks_per_node=2)


@pytest.mark.parametrize("cfg,exc", [({"stage": 2}, ValueError), ([], TypeError),
                                     ({"stage": 3, "zero_hpz_partition_size": 0}, ValueError)])
def test_from_deepspeed_rejects(cfg, exc):
    with pytest.raises(exc):
        zero.ZeroConfig.from_deepspeed(cfg)


def test_optimizer_on_an_unsharded_model_is_a_type_error():
    with pytest.raises(TypeError, match="qcoll.zero.shard"):
        zero.Optimizer(nn.Linear(2, 2), torch.optim.SGD, lr=0.1)


def test_shard_before_init_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed"):
        zero.shard(nn.Linear(2, 2))


def _misuse(rank, world):
    with pytest.raises(ValueError, match="not divisible by ranks_per_node=3"):
        qcoll.Topology(3)
    topo = qcoll.Topology(2)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"unit 1 \(ReLU\) has no parameters"):
        zero.shard(model, topo, units=[model[0], model[1]])
    with pytest.raises(ValueError, match="not a submodule"):
        zero.shard(model, topo, units=[nn.Linear(1, 1)])
    with pytest.raises(TypeError, match="config"):
        zero.shard(model, topo, config={"weight_bits": 8})
    m = zero.shard(model, topo)
    assert m is model  # sharded in place
    with pytest.raises(ValueError, match="already sharded"):
        zero.shard(m, topo)
    with pytest.raises(ValueError, match=r"parameter 'weight' is already managed"):  # a part of a sharded model
        zero.shard(m[0], topo)
    with pytest.raises(TypeError, match="optimizer_class"):
        zero.Optimizer(m, "adam")
    with pytest.raises(TypeError, match="sharded by qcoll.zero.shard"):
        zero.save("/nonexistent", tiny_model(0))
    return True


def test_misuse_errors_on_4_ranks(ranks4):
    assert ranks4.run(_misuse, timeout=60) == [True] * 4


def _units_by_class(rank, world):
    from qcoll.testing.models import Block
    topo = qcoll.Topology(2)
    m = zero.shard(tiny_model(0), topo, units=[Block])
    by_class = [g.name for g in zero.state_of(m).groups]
    model = tiny_model(0)
    with pytest.raises(ValueError, match=r"unit blocks is a ModuleList.*never called"):
        zero.shard(model, topo, units=[model.blocks])
    x = torch.randint(0, 256, (2, model.cfg.context), generator=torch.Generator().manual_seed(rank))
    losses = []
    for units in (None, "explicit"):
        model = tiny_model(0)
        m = zero.shard(model, topo, zero.ZeroConfig.zero3(), units=model.units() if units else None)
        loss = m(x, x)
        loss.backward()
        losses.append(float(loss))
    return by_class, [g.name for g in zero.state_of(zero.shard(tiny_model(0), topo)).groups], losses


def test_units_by_module_class(ranks4):
    by_class, default, losses = ranks4.run(_units_by_class, timeout=60)[0]
    assert by_class == ["<root>", "blocks.0", "blocks.1"]
    # the default units are the entries of the ModuleList of blocks; the root takes the rest
    assert default == ["<root>", "blocks.0", "blocks.1"]
    assert losses[0] == losses[1]  # same model, same units: the same unquantized loss


def _released_parameters(rank, world):
    topo = qcoll.Topology(2)
    model = tiny_model(0)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    m = zero.shard(model, topo)
    seen = {}
    block = model.blocks[0]
    block.register_forward_pre_hook(  # runs after the engine's own pre-hook has gathered the unit
        lambda mod, args: seen.update({n: tuple(p.shape) for n, p in mod.named_parameters()}))
    opt = zero.Optimizer(m, torch.optim.SGD, lr=0.1)
    x = torch.randint(0, 256, (2, model.cfg.context), generator=torch.Generator().manual_seed(rank))
    loss = m(x, x)
    loss.backward()
    opt.step()
    released = {n: (p.numel(), p.dtype, p.device.type, repr(p).startswith("Parameter containing"))
                for n, p in model.named_parameters()}
    full = m.state_dict()
    with torch.no_grad():
        before = float(m(x, x))
        m.load_state_dict(full)
        again = float(m(x, x))
    after = m.state_dict()
    return shapes, seen, released, {k: tuple(v.shape) for k, v in full.items()}, \
        all(torch.equal(full[k], after[k]) for k in full), (before, again)


def test_released_parameters_are_empty_not_dangling(ranks4):
    """Outside forward/backward a parameter is an empty tensor (reading it once crashed the
    process: its view pointed into freed storage); inside its unit's forward it has its shape."""
    for shapes, seen, released, full_shapes, round_trip, (before, again) in ranks4.run(_released_parameters,
                                                                                      timeout=90):
        assert seen == {n[len("blocks.0."):]: s for n, s in shapes.items() if n.startswith("blocks.0.")}
        assert released == {n: (0, torch.float32, "cpu", True) for n in shapes}
        assert {k: v for k, v in full_shapes.items() if k in shapes} == shapes
        assert round_trip  # loading the full state dict gives back the same state
        assert again == before and again == again  # and the same (finite) loss


def test_a_module_list_with_its_own_forward_can_be_a_unit():
    from qcoll.zero.units import select_units

    class Blocks(nn.ModuleList):
        def forward(self, x):
            for b in self:
                x = b(x)
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = Blocks([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.plain = nn.ModuleList([nn.Linear(4, 4)])

        def forward(self, x):
            return self.plain[0](self.blocks(x))

    net = Net()
    assert [name for name, _ in select_units(net, None)] == ["blocks.0", "blocks.1", "plain.0"]
    assert [name for name, _ in select_units(net, [net.blocks])] == ["blocks"]


def _frozen_middle_and_partial_load(rank, world):
    import copy
    import dataclasses

    topo = qcoll.Topology(2)
    results = {}
    for prefetch in (0, 1):
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1))
        plain[1].requires_grad_(False)
        plain[2].requires_grad_(False)
        model = zero.shard(copy.deepcopy(plain), topo, dataclasses.replace(zero.ZeroConfig.zero3(), prefetch=prefetch))
        opt = zero.Optimizer(model, torch.optim.SGD, lr=0.5)
        ref_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same batch on every rank
        model(x).sum().backward()
        opt.step()
        plain(x).sum().backward()
        ref_opt.step()
        got, want = model.state_dict(), plain.state_dict()
        results[prefetch] = max(float((got[k] - want[k]).abs().max()) for k in want)
    before = model.state_dict()
    model.load_state_dict({"0.weight": torch.ones(8, 8)}, strict=False)
    after = model.state_dict()
    kept = all(torch.equal(after[k], before[k]) for k in before if k != "0.weight")
    with pytest.raises(TypeError, match=r"state_dict\['0.bias'\] must be a tensor, got float"):
        model.load_state_dict({"0.bias": 1.0}, strict=False)
    return results, kept, torch.equal(after["0.weight"], torch.ones(8, 8))


def test_frozen_units_between_trainable_ones_and_partial_loads(ranks4):
    """Gradients flow back through frozen units (gathered again for backward) and match the
    unsharded model's SGD step; load_state_dict(strict=False) keeps the values it is not given."""
    for results, kept, loaded in ranks4.run(_frozen_middle_and_partial_load, timeout=90):
        assert results[0] < 1e-5 and results[1] < 1e-5, results
        assert kept and loaded
