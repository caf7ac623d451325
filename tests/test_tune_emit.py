"""A chosen configuration is usable as printed (issue 43): every form over every point of the default spaces.

The forms (:mod:`qcoll.tune.emit`): the DeepSpeed JSON (``json.loads`` / ``json.load`` of a file, then
``ZeroConfig.from_deepspeed`` with the run's ranks per node, without a warning, gives back the chosen
configuration field by field), the ``ZeroConfig(...)`` line (``eval`` with ``ZeroConfig`` and ``torch``
in scope), and ``quantize_comm``'s keyword arguments (bound by its signature and passing its own argument
checks). The spaces: ``qcoll-bench tune``'s (24 points), ``zeropp_space()`` (1440) and ``online_space()``
(384) as dicts, and AutoTune's configurations (``with_knobs(base, **point)``, what ``AutoTune.config``
holds and ``train --auto`` prints) as ZeroConfigs. Then where it is printed: ``tune`` / ``train --auto``
(``--emit-config``), and the serving scheduler's ``/metrics`` (the body ``PUT /admin/config`` takes).
No processes.
"""
import dataclasses
import inspect
import json
import os
import warnings

import pytest
import torch
import torch.nn as nn

from qcoll import tune
from qcoll.bench import tune as bench_tune
from qcoll.fsdp import quantize_comm
from qcoll.zero import ZeroConfig
from qcoll.zero.config import _DS_KNOWN
from qcoll.zero.reconfigure import with_knobs

RANKS_PER_NODE = (1, 2, 4)
#: a base far from the defaults (the fields no knob switches), as a model may be sharded with
WIDE_BASE = ZeroConfig(weight_block=128, grad_block=512, compute_dtype=torch.bfloat16, persist_threshold=10_000,
                       stochastic_grad_rounding=True, grad_hadamard=True, weight_outliers=1, grad_outliers=2,
                       hpz_partition_size=2, broadcast_buffers=False, reshard_after_backward=False)


def _dicts():
    """(space name, config dict) of every point of the three default spaces."""
    for name, sp in (("tune", bench_tune.space()), ("zeropp", tune.zeropp_space()), ("online", tune.online_space())):
        for point in sp.points():
            yield name, sp.config(point)


def _autotune_configs():
    """(ranks per node, ZeroConfig) of AutoTune's every configuration on the default and a wide base."""
    sp = tune.online_space()
    for base, nodes in ((ZeroConfig(), RANKS_PER_NODE), (WIDE_BASE, (2,)),
                        (ZeroConfig(compute_dtype=torch.float32, hpz_partition_size=4), (4,))):
        for point in sp.points():
            for L in nodes:
                yield L, with_knobs(base, **sp.config(point))


def _quiet_read(doc, L):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return ZeroConfig.from_deepspeed(doc, L)


def _check_deepspeed_doc(doc, L):
    """DeepSpeed's schema: its own keys only, in zero_optimization, with real numbers (no placeholder)."""
    zo = doc["zero_optimization"]
    assert set(zo) <= _DS_KNOWN and zo["stage"] == 3, zo
    assert all(isinstance(v, (bool, int)) for v in zo.values()), zo
    assert zo["zero_hpz_partition_size"] in (1, L)
    assert set(doc) <= {"zero_optimization", "bf16", "fp16", "qcoll"}, doc


# ---------------------------------------------------------------------------- the DeepSpeed JSON
def test_the_json_round_trips_every_point_of_the_default_spaces():
    n = 0
    for name, config in _dicts():
        for L in RANKS_PER_NODE:
            doc = tune.deepspeed_json(config, L)
            text = json.dumps(doc)              # JSON as is: no tuple, dtype or placeholder
            _check_deepspeed_doc(json.loads(text), L)
            assert _quiet_read(json.loads(text), L) == ZeroConfig(**config), (name, config, text)
            n += 1
    assert n == 3 * (24 + 1440 + 384)


def test_the_json_round_trips_every_autotune_configuration():
    for L, cfg in _autotune_configs():
        doc = json.loads(json.dumps(tune.deepspeed_json(cfg, L)))
        _check_deepspeed_doc(doc, L)
        got = _quiet_read(doc, L)
        assert got == cfg, (cfg, doc)
        assert all(getattr(got, f.name) == getattr(cfg, f.name) for f in dataclasses.fields(cfg))


def test_emit_config_file_round_trips_every_point_of_tunes_space(tmp_path):
    """``--emit-config FILE``'s writer: ``from_deepspeed(json.load(open(FILE)), L)`` is the chosen config."""
    sp = bench_tune.space()
    path = str(tmp_path / "ds.json")
    for point in sp.points():
        for L in RANKS_PER_NODE:
            tune.write_config(path, sp.config(point), L)
            with open(path) as f:
                assert _quiet_read(json.load(f), L) == ZeroConfig(**sp.config(point))
    assert os.listdir(tmp_path) == ["ds.json"]    # atomic: no temporary file left


def test_the_json_says_what_deepspeed_maps_and_carries_the_rest_under_qcoll():
    doc = tune.deepspeed_json({"weight_bits": 8, "grad_bits": 4, "hpz": True, "prefetch": 2}, 8)
    assert doc["zero_optimization"] == {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                                        "zero_hpz_partition_size": 8, "stage3_param_persistence_threshold": 0,
                                        "reduce_bucket_size": 0}
    # qcoll's hpZ group is the node (hpz_partition_size None); DeepSpeed's key says the node's size
    assert doc["qcoll"] == {"prefetch": 2, "hpz_partition_size": None}
    doc = tune.deepspeed_json(ZeroConfig.zero3(), None)     # no hpZ: no ranks per node needed
    assert doc["zero_optimization"]["zero_hpz_partition_size"] == 1 and "qcoll" not in doc
    doc = tune.deepspeed_json({"weight_bits": 4, "grad_bits": (8, 4), "compute_dtype": torch.bfloat16}, 2)
    assert doc["bf16"] == {"enabled": True} and doc["qcoll"] == {"weight_bits": 4, "grad_bits": [8, 4],
                                                                 "hpz_partition_size": None}
    with pytest.raises(ValueError, match="pass ranks_per_node"):
        tune.deepspeed_json({"hpz": True})
    with pytest.raises(ValueError, match="ranks_per_node=4"):
        tune.deepspeed_json(ZeroConfig(hpz_partition_size=2), 4)
    with pytest.raises(TypeError, match="ZeroConfig or a dict"):
        tune.deepspeed_json("w8 g4")


def test_from_deepspeed_reads_the_qcoll_section():
    ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True},
          "qcoll": {"weight_bits": 4, "grad_bits": [8, 4], "compute_dtype": "float32"}}
    cfg = _quiet_read(ds, None)                                  # "qcoll" is not an ignored key
    assert (cfg.weight_bits, cfg.grad_bits, cfg.compute_dtype) == (4, (8, 4), torch.float32)
    assert ZeroConfig.from_deepspeed(ds, weight_bits=2).weight_bits == 2        # overrides win over it
    assert ZeroConfig.from_deepspeed(ds["zero_optimization"]).weight_bits == 8  # a section alone: none
    with pytest.raises(ValueError, match=r"qcoll\.weight_bitz is not a ZeroConfig field"):
        ZeroConfig.from_deepspeed({**ds, "qcoll": {"weight_bitz": 4}})
    with pytest.raises(ValueError, match="compute_dtype must be"):
        ZeroConfig.from_deepspeed({**ds, "qcoll": {"compute_dtype": "torch.bfloat16"}})
    with pytest.raises(TypeError, match="'qcoll' section must be a dict"):
        ZeroConfig.from_deepspeed({**ds, "qcoll": [4]})
    # hpZ off in the section drops DeepSpeed's partition size, unless the section sets one
    ds = {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 4}, "qcoll": {"hpz": False}}
    assert _quiet_read(ds, 4).hpz_partition_size is None


# ---------------------------------------------------------------------------- the ZeroConfig(...) line
def test_the_zero_config_line_constructs_as_printed_over_the_default_spaces():
    scope = {"ZeroConfig": ZeroConfig, "torch": torch}
    for _, config in _dicts():
        assert eval(tune.zero_config_line(config), scope) == ZeroConfig(**config)
    for _, cfg in _autotune_configs():
        line = tune.zero_config_line(cfg)
        assert eval(line, scope) == cfg, line
    assert tune.zero_config_line(ZeroConfig()) == "ZeroConfig()"
    assert (tune.zero_config_line(ZeroConfig(grad_bits=(8, 4), compute_dtype=torch.bfloat16)) ==
            "ZeroConfig(grad_bits=(8, 4), compute_dtype=torch.bfloat16)")


# ---------------------------------------------------------------------------- quantize_comm's arguments
def _checked_by_quantize_comm(kwargs):
    """``quantize_comm``'s signature binds them and its argument checks pass: on a module with no FSDP2
    module it then fails at its first look at the model, with that error."""
    inspect.signature(quantize_comm).bind(None, None, **kwargs)
    with pytest.raises(ValueError, match="no FSDP2 module under Linear"):
        quantize_comm(nn.Linear(2, 2), None, **kwargs)


def test_quantize_comm_kwargs_pass_its_checks_over_the_default_spaces():
    module = nn.Linear(2, 2)
    for _, config in [*_dicts(), *((None, cfg) for _, cfg in _autotune_configs())]:
        kwargs, left = tune.quantize_comm_kwargs(config)
        cfg = tune.zero_config(config)
        assert kwargs["weight_bits"] == cfg.weight_bits and kwargs["hadamard"] == cfg.grad_hadamard
        assert not set(left) & set(tune.emit.QUANTIZE_COMM_ARGS)
        _checked_by_quantize_comm(kwargs)
        called = {}
        line = tune.quantize_comm_line(config)     # the printed call: the same arguments
        eval(line, {"quantize_comm": lambda m, t, **kw: called.update(kw), "model": module, "topology": None})
        assert called == kwargs, line


def test_quantize_comm_note_names_what_fsdp2_sets_and_what_is_left_out():
    note = tune.emit.quantize_comm_note(WIDE_BASE, 2)
    assert "reshard_after_forward=2" in note and "compute_dtype=torch.bfloat16 (MixedPrecisionPolicy" in note
    assert "left out: stochastic_grad_rounding=True" in note and "hpz_partition_size" not in note
    assert tune.emit.quantize_comm_note(ZeroConfig(hpz=False)) == ""


# ---------------------------------------------------------------------------- the printed block
def test_config_lines_each_form_usable_as_printed():
    scope = {"ZeroConfig": ZeroConfig, "torch": torch}
    sp = bench_tune.space()
    for point in sp.points():
        config = sp.config(point)
        lines = tune.config_lines(config, 2, indent="  ")
        zero_line = next(x for x in lines if x.strip().startswith("ZeroConfig: "))
        assert eval(zero_line.strip()[len("ZeroConfig: "):], scope) == ZeroConfig(**config)
        (json_line,) = [x for x in lines if x.strip().startswith("{")]
        assert _quiet_read(json.loads(json_line), 2) == ZeroConfig(**config)
        fsdp = next(x for x in lines if x.strip().startswith("FSDP2: "))
        called = {}
        eval(fsdp.strip()[len("FSDP2: "):], {"quantize_comm": lambda m, t, **kw: called.update(kw), "model": None,
                                            "topology": None})
        assert called == tune.quantize_comm_kwargs(config)[0]


# ---------------------------------------------------------------------------- qcoll-bench: --emit-config
@pytest.mark.parametrize("argv,message", [
    (["tune", "--emit-config", "/nonexistent-folder/ds.json"], "--emit-config /nonexistent-folder/ds.json: folder"),
    (["tune", "--record", "t.json", "--emit-config", "ds.json"], "live search"),
    (["tune", "--replay", "t.json", "--emit-config", "ds.json"], "live search"),
    (["train", "--emit-config", "ds.json"], "needs --auto"),
    (["train", "--auto", "rrl", "--steps", "80", "--emit-config", "/nonexistent-folder/ds.json"],
     "--emit-config /nonexistent-folder/ds.json: folder"),
])
def test_emit_config_is_checked_before_anything_runs(argv, message, capsys):
    from qcoll.bench import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err


def test_tune_prints_and_writes_the_best_usable_as_printed(tmp_path, capsys):
    """``qcoll-bench tune``'s report (rank 0's, after the search): each form parses as printed, the file too."""
    sp = bench_tune.space()
    best = tune.RandomSearch(sp, seed=0)
    points = sp.points()
    for k, p in enumerate(points[:5]):
        best.tell(p, 1.0 + k, True)
    args = type("Args", (), {"emit_config": str(tmp_path / "ds.json"), "json": str(tmp_path / "t.json"),
                             "plot": None, "tuner": "random"})()
    bench_tune._report_best(sp, best, {p: 2.0 for p in points}, args, (sp.config(points[-1]), 1.0, 2.0), 2.0, 2)
    out = capsys.readouterr().out.splitlines()
    chosen = ZeroConfig(**sp.config(points[0]))
    (json_line,) = [x for x in out if x.strip().startswith("{")]
    assert _quiet_read(json.loads(json_line), 2) == chosen
    with open(tmp_path / "ds.json") as f:
        assert _quiet_read(json.load(f), 2) == chosen
    doc = json.loads((tmp_path / "t.json").read_text())
    assert _quiet_read(doc["deepspeed"], doc["ranks_per_node"]) == chosen
    assert eval(doc["zero_config"], {"ZeroConfig": ZeroConfig, "torch": torch}) == chosen


def test_train_auto_prints_each_settled_configuration_and_writes_the_fastest(tmp_path, monkeypatch):
    from qcoll.bench import train_auto

    monkeypatch.setattr(train_auto, "_slowest", lambda values: list(values))
    settled = {"auto-rrl": with_knobs(ZeroConfig(), weight_bits=4, grad_bits=(8, 4), prefetch=2),
               "auto-tpe": with_knobs(ZeroConfig(), weight_bits=None, hpz=False)}
    runs = [{"mode": "zeropp", "step_seconds": [1.0] * 6},
            {"mode": "auto-rrl", "step_seconds": [1.0] * 6}, {"mode": "auto-tpe", "step_seconds": [0.5] * 6}]
    for r in runs[1:]:
        cfg = settled[r["mode"]]
        r["auto"] = {"labels": ["x"] * 6, "switches": 1, "decision_bytes": 0, "final": "x",
                     "final_config": {"ranks_per_node": 2, "zero_config": tune.zero_config_line(cfg),
                                      "deepspeed": tune.deepspeed_json(cfg, 2),
                                      "quantize_comm": tune.quantize_comm_line(cfg)}}
    train_auto.summarize(runs, settle=1)
    json.dumps(runs)                                    # the records stay JSON (train --json)
    text = train_auto.format_auto(runs, 1)
    json_lines = [x for x in text.splitlines() if x.strip().startswith("{")]
    assert [_quiet_read(json.loads(x), 2) for x in json_lines] == [settled["auto-rrl"], settled["auto-tpe"]]
    args = type("Args", (), {"emit_config": str(tmp_path / "ds.json"), "settle": 1})()
    assert "auto-tpe settled on" in train_auto.emit_config(args, runs)      # the lower mean_after_s
    with open(tmp_path / "ds.json") as f:
        assert _quiet_read(json.load(f), 2) == settled["auto-tpe"]


# ---------------------------------------------------------------------------- serving: /metrics
def test_metrics_running_configuration_is_put_admin_configs_body():
    """The scheduler's and the server's running configuration as ``config_body``: JSON that ``PUT
    /admin/config`` (:func:`qcoll.serve.admin.updated_config`) takes as is and applies exactly, for every
    point of the default serving space."""
    pytest.importorskip("starlette", reason="the serve extra")
    from qcoll.serve import admin
    from qcoll.serve.app import Server
    from qcoll.serve.batcher import BatchConfig
    from qcoll.serve.scheduler import SloScheduler, serve_space, to_config

    class Runner:
        def set_threads(self, n):
            pass

    sp = serve_space()
    for point in sp.points():
        config = to_config(sp, point)
        server = Server(Runner(), config=config)
        for body in (server.metrics()["config_body"], SloScheduler(0.1, "random", start=config).state()["config_body"]):
            body = json.loads(json.dumps(body))
            assert admin.updated_config(body, BatchConfig(max_batch_size=1), server.batcher.max_queue) == config
