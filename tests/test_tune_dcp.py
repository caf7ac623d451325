"""An AutoTune's state through torch.distributed.checkpoint (DCP) on the FSDP2 path (issue 41, item 3),
as tensors only (DCP unpickles non-tensor values without restricting the classes).

Oracles: the AutoTune's own ``state_dict`` before the save, and the configuration FSDP2 runs after the
load (``comm_settings``) against the saved point; damaged states are refused by name before anything
changes.
"""
import pytest
import torch
import torch.distributed.checkpoint as dcp

import qcoll
from qcoll.fsdp import comm_settings, quantize_comm
from qcoll.testing.data import Batches, corpus
from qcoll.testing.fsdp2 import fsdp2_transformer
from qcoll.tune import AutoTune, AutoTuneState, Knob, Space

SPACE = Space([Knob("weight_bits", (4, 8, None)), Knob("grad_bits", (4, 8, None))])


def _auto(rank, world):
    model = fsdp2_transformer(reshard_after_forward=2)
    quantize_comm(model, qcoll.Topology(2), weight_bits=8, grad_bits=4)
    return model, AutoTune(model, space=SPACE, window=1, explore=6, abort=100.0, drift_tolerance=1000.0, seed=3)


def _save_then_load(rank, world, path):
    model, auto = _auto(rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = Batches(corpus(), 8, 32, 3)
    for _ in range(7):
        x, y = batches.next(rank, world)
        model(x, y).backward()
        opt.step()
        auto.update()
        opt.zero_grad()
    saved = auto.state_dict()
    dcp.save({"autotune": AutoTuneState(auto)}, checkpoint_id=path)
    fresh_model, fresh = _auto(rank, world)
    before = fresh.state_dict()
    dcp.load({"autotune": AutoTuneState(fresh)}, checkpoint_id=path)
    kinds = {k: type(v).__name__ for k, v in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()}
    chosen = fresh.space.config(fresh.point)
    running = comm_settings(fresh_model)
    return saved, before, fresh.state_dict(), kinds, (chosen["weight_bits"], chosen["grad_bits"]), \
        (running["weight_bits"], running["grad_bits"])


def test_autotune_state_round_trips_through_dcp_as_tensors(ranks4, tmp_path):
    results = ranks4.run(_save_then_load, str(tmp_path / "ckpt"), timeout=300)
    for saved, before, loaded, kinds, chosen, running in results:
        assert saved["steps"] > 0 and before["steps"] == 0 and saved["policy"]["trials"]   # measured, then fresh
        assert loaded == saved                    # measurements, phase and point, as saved
        assert chosen == running                  # FSDP2 runs the restored configuration
        assert kinds == {"autotune.json": "TensorStorageMetadata", "autotune.length": "TensorStorageMetadata"}


class _Stub:
    def __init__(self):
        self.loaded = None

    def state_dict(self):
        return {"version": 1, "steps": 3}

    def load_state_dict(self, doc):
        self.loaded = doc


def test_a_damaged_state_is_refused_by_name_and_changes_nothing():
    stub = _Stub()
    state = AutoTuneState(stub, capacity=64).state_dict()
    AutoTuneState(stub, capacity=64).load_state_dict(state)
    assert stub.loaded == {"version": 1, "steps": 3}          # a sound one goes through
    stub.loaded = None
    cases = [({**state, "length": torch.tensor([65])}, "outside 1..64"),
             ({**state, "length": torch.tensor([0])}, "outside 1..64"),
             ({**state, "length": torch.tensor([1.0])}, "not one int64"),
             ({**state, "json": state["json"].float()}, "not a uint8 vector"),
             ({**state, "json": torch.full((64,), 0xFF, dtype=torch.uint8)}, "not JSON"),
             ({**state, "json": torch.tensor(list(b"[" * 64), dtype=torch.uint8), "length": torch.tensor([64])},
              "not JSON")]
    for bad, words in cases:
        with pytest.raises(ValueError, match=words):
            AutoTuneState(stub, capacity=64).load_state_dict(bad)
    assert stub.loaded is None
    with pytest.raises(ValueError, match="more than capacity=64"):
        AutoTuneState(type("Big", (_Stub,), {"state_dict": lambda self: {"x": "y" * 100}})(), capacity=64).state_dict()
    with pytest.raises(TypeError, match="AutoTune"):
        AutoTuneState(object())
    with pytest.raises(ValueError, match="capacity"):
        AutoTuneState(stub, capacity=8)
