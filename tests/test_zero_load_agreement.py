"""A load succeeds on every rank or fails on every rank, before anything changes (issue 38, items 3-4).

A checkpoint with a damaged ``autotune.state`` or optimizer hyper-parameters the optimizer would
not accept makes ``qcoll.zero.load`` raise the same ValueError, naming the field or key, on every
rank, with the model's weights, the optimizer's state and hyper-parameters and the tuner (its
configuration, counters, policy) as they were. Oracles: snapshots before and after each load; the
valid checkpoint loading (and changing all of them) shows the snapshots would see a change.
"""
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qcoll
from qcoll import zero
from qcoll.testing import Batches, corpus, tiny_model
from qcoll.tune import AutoTune, Knob, Space
from qcoll.zero import checkpoint_safety as cs
from qcoll.zero.load_checks import check_param_groups

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one-process DCP
TIMEOUT = 120
SPACE = Space([Knob("weight_bits", (4, 8)), Knob("grad_bits", (4, 8, None)), Knob("hpz", (False, True))])


def _build(seed):
    model = tiny_model(seed)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(), units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    auto = AutoTune(m, space=SPACE, window=1, explore=6, abort=100.0, weight_error=10.0, grad_error=10.0, seed=1)
    return m, opt, auto


def _train(m, opt, auto, steps, rank, world, seed):
    batches = Batches(corpus(), 8, 32, seed)
    for _ in range(steps):
        x, y = batches.next(rank, world)
        m(x, y).backward()
        opt.step()
        auto.update()
        opt.zero_grad()


def _save(rank, world, path):
    m, opt, auto = _build(0)
    _train(m, opt, auto, 5, rank, world, 3)  # 4 timed steps, window 1: 4 decisions
    zero.save(path, m, opt, autotune=auto)
    return auto.state_dict(), m.state_dict()


def _snapshot(m, opt, auto):
    groups = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in pg.items() if k != "params"}
              for pg in opt.param_groups]
    state = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
             for pg in opt.param_groups for p in pg["params"]]
    tuner = (auto.point, auto.config, auto.steps, auto.switches, auto._next,
             auto.policy.state_dict() if auto.policy is not None else None)
    return m.state_dict(), groups, state, tuner, zero.state_of(m).engine.micro_step


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _error(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    return None


def _nudge(m, opt):
    with torch.no_grad():
        for master in opt.masters:
            master.add_(1e-3)
            for v in opt.state[master].values():
                if isinstance(v, torch.Tensor) and v.shape == master.shape:
                    v.add_(1e-3)
    zero.state_of(m).engine.micro_step += 1


def _load_all(rank, world, cases, good, saved_doc, split_doc):
    """Each bad case's load (error, unchanged); a rank-split AutoTune.load_state_dict; then the good load."""
    m, opt, auto = _build(7)
    _train(m, opt, auto, 2, rank, world, 5)  # optimizer state, and the tuner's first decision
    out = {}
    for name, path in cases.items():
        _nudge(m, opt)  # away from the checkpoint, even if an earlier case (wrongly) loaded it
        before = _snapshot(m, opt, auto)
        err = _error(zero.load, path, m, opt, autotune=auto)
        out[name] = (err, _equal(before, _snapshot(m, opt, auto)))
    before = _snapshot(m, opt, auto)  # only rank 3's state is damaged: every rank refuses it alike
    err = _error(auto.load_state_dict, split_doc if rank == 3 else saved_doc)
    out["split"] = (err, _equal(before, _snapshot(m, opt, auto)))
    before = _snapshot(m, opt, auto)
    err = _error(zero.load, good, m, opt, autotune=auto)
    out["good"] = (err, _equal(before, _snapshot(m, opt, auto)), auto.state_dict(), m.state_dict())
    return out


def _write_variant(src, dst, doc=None, groups=None):
    """``src`` rewritten in one process with its autotune.state replaced by ``doc(state)`` and/or its
    param groups by ``groups(list)`` (each edits in place)."""
    md = cs.read_metadata(src)
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(state, storage_reader=cs.SafeReader(src, md), no_dist=True)
    if doc is not None:
        tuned = cs.from_json_tensor(state["autotune.state"], "test")
        doc(tuned)
        state["autotune.state"] = cs.json_tensor(tuned)
    if groups is not None:
        hp = cs.decode_param_groups(state["optim.param_groups"], "test")
        groups(hp)
        state["optim.param_groups"] = cs.encode_param_groups(hp)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(dst), no_dist=True)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _set0(key, value):
    return lambda groups: groups[0].__setitem__(key, value)


_BAD_DOCS = {  # case: (edit of the AutoTune state, what the message names)
    "policy": (lambda d: d["policy"]["trials"][0].__setitem__(0, [9, 0, 0]), "'policy': trials[0] point"),
    "no point": (lambda d: d.pop("point"), "lacks 'point'"),
    "float point": (lambda d: d.__setitem__("point", [float(i) for i in d["point"]]), "'point' must be a list of"),
    "next 10**30": (_set("next", 10**30), "'next' must be at most 1"),
}
_BAD_GROUPS = {
    "lr nan": (_set0("lr", math.nan), "['lr'] must be finite"),
    "lr -1e308": (_set0("lr", -1e308), "['lr'] = -1e+308: AdamW refuses it"),
    "lr abc": (_set0("lr", "abc"), "['lr'] must be float or tensor, got str"),
    "betas of one": (_set0("betas", (0.9,)), "['betas'] must have 2 elements"),
    "unknown key": (_set0("bogus", 1.0), "unknown hyper-parameter(s) 'bogus'"),
    "foreach yes": (_set0("foreach", "yes"), "['foreach'] must be None or bool, got str"),
}


def test_a_bad_state_or_hyper_parameter_fails_on_every_rank_and_changes_nothing(ranks4, tmp_path):
    src = str(tmp_path / "ck")
    saved_doc, saved_weights = ranks4.run(_save, src, timeout=TIMEOUT)[0]
    assert saved_doc["switches"] >= 1 and saved_doc["next"] == 1   # the loads below would change the tuner
    cases, needles = {}, {}
    for name, (edit, needle) in _BAD_DOCS.items():
        cases[name], needles[name] = str(tmp_path / name.replace(" ", "_")), "autotune.state: the AutoTune state"
        _write_variant(src, cases[name], doc=edit)
        needles[name] = (needles[name], needle)
    for name, (edit, needle) in _BAD_GROUPS.items():
        cases[name] = str(tmp_path / name.replace(" ", "_"))
        _write_variant(src, cases[name], groups=edit)
        needles[name] = ("optim.param_groups[0]", needle)
    good = str(tmp_path / "good")  # a scheduler's key is not unknown
    _write_variant(src, good, groups=_set0("initial_lr", 3e-3))
    split = {**saved_doc, "next": 10**30}
    out = ranks4.run(_load_all, cases, good, saved_doc, split, timeout=TIMEOUT)
    for name, path in cases.items():
        errors = {r[name][0] for r in out}
        assert len(errors) == 1, (name, errors)               # the same error on every rank
        (err,) = errors
        assert err is not None and err[0] == "ValueError", (name, err)
        assert repr(path) in err[1] and all(n in err[1] for n in needles[name]), (name, err[1])
        assert "nothing was loaded" in err[1], (name, err[1])
        assert all(r[name][1] for r in out), f"{name}: something changed"
    errors = {r["split"][0] for r in out}
    assert len(errors) == 1 and next(iter(errors))[0] == "ValueError", errors
    assert "'next' must be at most" in next(iter(errors))[1]
    assert all(r["split"][1] for r in out), "the rank-split load_state_dict changed something"
    for r in out:  # the valid checkpoint loads, and changes what the snapshots compare
        err, unchanged, doc, weights = r["good"]
        assert err is None and not unchanged, err
        assert doc == saved_doc and _equal(weights, saved_weights)


def test_hyper_parameters_are_checked_against_the_optimizer_class():
    p = torch.zeros(3, requires_grad=True)

    def check(opt, **change):
        live = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
        return check_param_groups(opt, [{**live, **change}], "ck")

    adam = torch.optim.Adam([p], lr=torch.tensor(1e-3))
    check(adam, lr=torch.tensor(2e-3), betas=(0.8, 0.9))                   # a tensor lr of the same shape
    with pytest.raises(ValueError, match=r"ck\[0\]\['lr'\] must keep the optimizer's shape \[\]"):
        check(adam, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match=r"\['betas'\] = \(1\.5, 0\.9\): Adam refuses it: .*beta parameter"):
        check(adam, betas=(1.5, 0.9))
    with pytest.raises(ValueError, match=r"\['betas'\]\[1\] must be finite"):
        check(adam, betas=(0.9, math.inf))
    with pytest.raises(ValueError, match=r"\['eps'\] must be finite"):
        check(adam, eps=10**400)                                             # an int beyond a float
    with pytest.raises(ValueError, match=r"\['amsgrad'\] must be bool, got int 1"):
        check(adam, amsgrad=1)
    with pytest.raises(ValueError, match=r"\['initial_lr'\] must be finite"):  # a scheduler's key: a number
        check(adam, initial_lr=math.nan)
    sgd = torch.optim.SGD([p], lr=0.1)                                      # momentum=0, an int
    check(sgd, momentum=0.9, nesterov=True, dampening=0)
    with pytest.raises(ValueError, match=r"\['momentum'\] = -0\.5: SGD refuses it"):
        check(sgd, momentum=-0.5)
    ada = torch.optim.Adafactor([p])                                        # eps=(None, 1e-3)
    check(ada, eps=(1e-30, 1e-3))
    with pytest.raises(ValueError, match=r"\['eps'\]\[0\] must be None or float, got str"):
        check(ada, eps=("x", 1e-3))
    keep_inf = torch.optim.SGD([p], lr=math.inf)                            # what the optimizer holds now
    check(keep_inf, lr=math.inf)
