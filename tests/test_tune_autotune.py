"""``qcoll.tune.AutoTune`` and ``qcoll.zero.reconfigure`` on 4 gloo ranks as 2 nodes x 2.

Oracles: for exactness, runs that use each configuration for the same steps without switching
(a model sharded anew with that configuration, its state carried over by a checkpoint); for the
error budget, the real qwZ gather's error against the exact weights; for the decisions, the
configuration every rank ran, which must be the same at every step.
"""
import dataclasses

import pytest
import torch

import qcoll
from qcoll import zero
from qcoll.comm import all_gather_quantized
from qcoll.comm.stats import stats
from qcoll.testing import Batches, corpus, tiny_model
from qcoll.tune import AutoTune, Knob, Space

TIMEOUT = 240
STEPS = 10
# weight bits stay quantized here: a model sharded with weight_bits=None has another layout, so the
# oracle (a model sharded anew with each configuration) would quantize gradients in other blocks
SPACE = Space([Knob("weight_bits", (4, 8)), Knob("grad_bits", (4, (8, 4), 8, None)), Knob("hpz", (False, True)),
               Knob("prefetch", (0, 1, 2)), Knob("hierarchical_gather", (False, True)),
               Knob("reduce_bucket_numel", (0, 1_000_000))])


def _shard(config, seed=0):
    model = tiny_model(seed)
    return zero.shard(model, qcoll.Topology(2), config, units=model.units())


def _batches():
    return Batches(corpus(), 8, 32, 3)


def _step(m, opt, batches, rank, world):
    x, y = batches.next(rank, world)
    m(x, y).backward()
    opt.step()


def _auto_run(rank, world, tuner):
    m = _shard(zero.ZeroConfig())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
    auto = AutoTune(m, tuner=tuner, space=SPACE, window=1, explore=8, abort=100.0, weight_error=10.0,
                    grad_error=10.0, seed=1)
    batches, ran = _batches(), []
    stats.reset()
    for _ in range(STEPS):
        ran.append(dataclasses.asdict(auto.config))
        _step(m, opt, batches, rank, world)
        auto.update()
        opt.zero_grad()
    return {"ran": ran, "state": m.state_dict(), "switches": auto.switches, "bytes": auto.decision_bytes,
            "calls": stats.calls.get("autotune.decision", 0), "phase": auto.phase}


def _oracle_run(rank, world, ran, tmp):
    """Each run of equal configurations on a model sharded anew with it; state carried by checkpoints."""
    batches, i, segment = _batches(), 0, 0
    while i < len(ran):
        j = i
        while j < len(ran) and ran[j] == ran[i]:
            j += 1
        m = _shard(zero.ZeroConfig(**ran[i]))
        opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
        if segment:
            zero.load(f"{tmp}/seg{segment - 1}", m, opt)
        for _ in range(j - i):
            _step(m, opt, batches, rank, world)
            opt.zero_grad()
        zero.save(f"{tmp}/seg{segment}", m, opt)
        i, segment = j, segment + 1
    return m.state_dict()


@pytest.mark.slow
def test_a_switching_run_equals_each_configuration_for_its_steps(ranks4, tmp_path):
    auto = ranks4.run(_auto_run, "random", timeout=TIMEOUT)
    ran = auto[0]["ran"]
    assert all(r["ran"] == ran for r in auto), "the ranks ran different configurations"
    configs = {str(c) for c in ran}
    assert len(configs) >= 4 and auto[0]["switches"] >= 3, configs
    oracle = ranks4.run(_oracle_run, ran, str(tmp_path), timeout=TIMEOUT)
    for key, value in oracle[0].items():
        assert torch.equal(auto[0]["state"][key], value), key
    # the decisions: 8 int64 broadcast by rank 0 (the others send only their part of the error all-reduces)
    assert auto[0]["calls"] >= auto[0]["switches"] and all(r["calls"] == auto[0]["calls"] for r in auto)
    assert all(auto[0]["bytes"] - r["bytes"] == 64 * auto[0]["calls"] for r in auto[1:])


def _budget(rank, world):
    m = _shard(zero.ZeroConfig())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
    space = Space([Knob("weight_bits", (4, 8, None)), Knob("grad_bits", (4, 8, None))])
    auto = AutoTune(m, space=space, window=1, explore=9, weight_error=0.02, grad_error=10.0)
    batches, ran = _batches(), []
    for _ in range(14):
        ran.append((auto.config.weight_bits, auto.config.grad_bits))
        _step(m, opt, batches, rank, world)
        auto.update()
        opt.zero_grad()
    # the real gather's error at 4 bits against the exact weights (the oracle of the measurement)
    errors = {}
    for bits in (4, 8):
        num = den = 0.0
        for g in zero.state_of(m).groups:
            exact = g.gather_full_fp32()
            out = torch.empty_like(exact)
            all_gather_quantized(out, g.master.detach(), bits=bits, block_size=256)
            num += float((out - exact).double().pow(2).sum())
            den += float(exact.double().pow(2).sum())
        errors[bits] = (num / den) ** 0.5
    from qcoll.tune.live_error import relative_errors
    measured = {bits: relative_errors(m, bits, None, 256, 128)[0] for bits in (4, 8)}
    return {"ran": ran, "errors": errors, "measured": measured}


@pytest.mark.slow
def test_configurations_over_the_error_budget_never_run(ranks4):
    out = ranks4.run(_budget, timeout=TIMEOUT)[0]
    for bits in (4, 8):
        assert out["measured"][bits] == pytest.approx(out["errors"][bits], rel=1e-6)
    assert out["errors"][4] > 0.02 > out["errors"][8]          # the budget falls between them
    assert out["ran"][0] == (8, 4)                              # the start
    assert all(w != 4 for w, _ in out["ran"]), out["ran"]       # 4-bit weights are over budget
    assert {w for w, _ in out["ran"]} == {8, None}


def _resume(rank, world, tmp):
    def build():
        m = _shard(zero.ZeroConfig())
        opt = zero.Optimizer(m, torch.optim.AdamW, lr=1e-2)
        return m, opt, AutoTune(m, tuner="rrl", space=SPACE, window=2, explore=20, abort=100.0, weight_error=10.0,
                                grad_error=10.0, seed=3)

    m, opt, auto = build()
    batches = _batches()
    for _ in range(9):
        _step(m, opt, batches, rank, world)
        auto.update()
        opt.zero_grad()
    zero.save(tmp, m, opt, autotune=auto)
    saved = auto.state_dict()
    m2, opt2, auto2 = build()
    zero.load(tmp, m2, opt2, autotune=auto2)
    resumed = auto2.state_dict()
    same_config = auto2.config == auto.config
    trials = len(auto2.policy.tuner.trials) if auto2.policy is not None else None
    # goes on: more steps, the exploration continues from the saved trials
    for _ in range(6):
        _step(m2, opt2, batches, rank, world)
        auto2.update()
        opt2.zero_grad()
    later = len(auto2.policy.tuner.trials) if auto2.policy is not None else None
    with pytest.raises(ValueError, match="has an AutoTune already"):
        AutoTune(m2)
    with pytest.raises(ValueError, match="tuner"):
        AutoTune(_shard(zero.ZeroConfig()), tuner="random", space=SPACE).load_state_dict(saved)
    return {"saved": saved, "resumed": resumed, "same_config": same_config, "trials": trials, "later": later,
            "explorations": auto2.policy.explorations if auto2.policy is not None else None}


@pytest.mark.slow
def test_save_and_load_carry_the_tuner(ranks4, tmp_path):
    out = ranks4.run(_resume, str(tmp_path / "ckpt"), timeout=TIMEOUT)
    r0 = out[0]
    assert r0["same_config"] and all(r["same_config"] for r in out)
    assert r0["resumed"]["policy"]["trials"] == r0["saved"]["policy"]["trials"]
    assert r0["trials"] == len(r0["saved"]["policy"]["trials"]) >= 4
    assert r0["later"] > r0["trials"] and r0["explorations"] == 1


def _reconfigure_rules(rank, world):
    m = _shard(zero.ZeroConfig())
    errors = {}
    for name, cfg in (("compute_dtype", zero.ZeroConfig(compute_dtype=torch.bfloat16)),
                      ("persist_threshold", zero.ZeroConfig(persist_threshold=10)),
                      ("weight_block", zero.ZeroConfig(weight_block=128))):
        with pytest.raises(ValueError, match=name):
            zero.reconfigure(m, cfg)
    with pytest.raises(TypeError, match="ZeroConfig"):
        zero.reconfigure(m, {"weight_bits": 4})
    x, y = _batches().next(rank, world)
    loss = m(x, y)                                   # its backward is pending: the wire format must not change
    with pytest.raises(RuntimeError, match="backward is pending"):
        zero.reconfigure(m, zero.ZeroConfig(weight_bits=4))
    loss.backward()
    zero.reconfigure(m, zero.ZeroConfig(weight_bits=None, hpz=False))
    # unquantized gathers on the block-aligned layout: the forward of the exact weights
    plain = tiny_model(1)
    plain.load_state_dict(m.state_dict())
    with torch.no_grad():
        errors["exact"] = torch.equal(m(x, y), plain(x, y))
    unaligned = _shard(zero.ZeroConfig.zero3(), seed=2)
    with pytest.raises(ValueError, match="layout"):
        zero.reconfigure(unaligned, zero.ZeroConfig(weight_bits=8))
    with pytest.raises(ValueError, match="block-aligned layout"):
        AutoTune(unaligned)
    with pytest.raises(ValueError, match="prefetch=5"):
        AutoTune(_shard(zero.ZeroConfig(prefetch=5), seed=3))
    with pytest.raises(ValueError, match="window"):     # on every rank, not only on rank 0 which decides
        AutoTune(_shard(zero.ZeroConfig(), seed=3), window=0)
    return errors


@pytest.mark.slow
def test_reconfigure_refuses_what_the_layout_fixed_and_busy_models(ranks4):
    assert all(r["exact"] for r in ranks4.run(_reconfigure_rules, timeout=TIMEOUT))


def _policy_state():
    """A policy's state after a few windows (4 configurations measured, one window under way)."""
    from qcoll.tune import OnlinePolicy, RandomSearch

    space = Space([Knob("a", (0, 1, 2)), Knob("b", (0, 1))])
    policy = OnlinePolicy(RandomSearch(space, seed=2), (0, 0), window=2, explore=4)
    due = policy.due()
    for t in (1.0, 1.1, 2.0, 2.1, 0.5, 0.6, 3.0, 3.1, 0.7, 0.5, 0.9):   # as AutoTune.update drives it
        policy.observe(t)
        due -= 1
        if due == 0:
            policy.decide()
            due = policy.due()
    state = policy.state_dict()
    assert state["trials"] and state["samples"] and state["times"] and state["trials"][0][2]
    return space, state


def _edit(state, path, value):
    *head, last = path
    for k in head:
        state = state[k]
    if value is _DROP:
        del state[last]
    else:
        state[last] = value


_DROP = object()


@pytest.mark.parametrize("path, value, needle", [
    (("trials",), _DROP, "no 'trials'"),
    (("current",), [1.0, 0.0], "current must be a list of 2 ints"),
    (("current",), [7, 0], r"current: \(7, 0\) is not a configuration"),
    (("trials", 0, 0), [0, True], r"trials\[0\] point must be a list of 2 ints"),
    (("trials", 0, 1), float("nan"), r"trials\[0\] cost must be a finite number >= 0"),
    (("trials", 0, 1), None, r"trials\[0\]: a feasible trial needs a cost"),
    (("trials", 0, 2), "yes", r"trials\[0\] feasible must be a bool"),
    (("samples", 0, 1), [], r"samples\[0\]: no window costs"),
    (("times",), [-1.0], "times must be a finite number >= 0"),
    (("first",), 99, "first must be"),
    (("phase",), "sleep", "phase must be one of"),
    (("explorations",), 0, "explorations must be"),
])
def test_policy_state_fields_are_checked_before_anything_changes(path, value, needle):
    import copy

    from qcoll.tune import OnlinePolicy, RandomSearch

    space, state = _policy_state()
    fresh = OnlinePolicy(RandomSearch(space, seed=2), (0, 0), window=2, explore=4)
    fresh.load_state_dict(copy.deepcopy(state))           # the state as saved loads
    assert fresh.state_dict() == state
    bad = copy.deepcopy(state)
    _edit(bad, path, value)
    target = OnlinePolicy(RandomSearch(space, seed=2), (0, 0), window=2, explore=4)
    before = target.state_dict()
    with pytest.raises(ValueError, match=needle):
        target.load_state_dict(bad)
    assert target.state_dict() == before
