"""Configuration search over qcoll's ZeRO++ knobs: RRL and its baselines (library code, no CLI).

    space = qcoll.tune.zeropp_space()
    tuner = qcoll.tune.RRL(space, seed=0)
    history = qcoll.tune.run(tuner, measure, budget=30)   # measure(config) -> (step seconds, feasible)
    best = tuner.best(); print(qcoll.tune.zero_config_line(space.config(best.point)))
    qcoll.tune.write_config("ds.json", space.config(best.point), ranks_per_node=8)   # DeepSpeed JSON (+ "qcoll")

Online, in the training loop (the wire format switched between steps, every rank at once)::

    auto = qcoll.tune.AutoTune(model)                    # a model sharded by qcoll.zero.shard
    for x, y in batches:
        model(x, y).backward(); opt.step(); auto.update(); opt.zero_grad()

With DCP (FSDP2): ``dcp.save({..., "autotune": qcoll.tune.AutoTuneState(auto)}, checkpoint_id=path)``.
"""
from .replay import Table, replay, replay_change
from .autotune import AutoTune
from .dcp_state import AutoTuneState
from .online_policy import OnlinePolicy
from .space import ONLINE_KNOBS, ZEROPP_KNOBS, Knob, Space, config_label, online_space, zeropp_space
from .emit import (config_lines, deepspeed_json, quantize_comm_kwargs, quantize_comm_line, write_config,
                   zero_config, zero_config_line)
from .tuners import RRL, TPE, TUNERS, Exhaustive, RandomSearch, Trial, Tuner, run, trials_to_within

__all__ = ["AutoTune", "AutoTuneState", "OnlinePolicy", "ONLINE_KNOBS", "online_space", "config_label", "Knob", "Space", "ZEROPP_KNOBS", "zeropp_space", "zero_config_line", "deepspeed_json",
           "zero_config", "quantize_comm_kwargs", "quantize_comm_line", "config_lines", "write_config", "Tuner", "Trial",
           "RRL", "RandomSearch", "TPE", "Exhaustive", "TUNERS", "run", "trials_to_within", "Table", "replay", "replay_change"]
