"""Configuration search over qcoll's ZeRO++ knobs: RRL and its baselines (library code, no CLI).

    space = qcoll.tune.zeropp_space()
    tuner = qcoll.tune.RRL(space, seed=0)
    history = qcoll.tune.run(tuner, measure, budget=30)   # measure(config) -> (step seconds, feasible)
    best = tuner.best(); print(qcoll.tune.zero_config_line(space.config(best.point)))
"""
from .replay import Table, replay, replay_change
from .space import ZEROPP_KNOBS, Knob, Space, deepspeed_json, zero_config_line, zeropp_space
from .tuners import RRL, TPE, TUNERS, Exhaustive, RandomSearch, Trial, Tuner, run, trials_to_within

__all__ = ["Knob", "Space", "ZEROPP_KNOBS", "zeropp_space", "zero_config_line", "deepspeed_json", "Tuner", "Trial",
           "RRL", "RandomSearch", "TPE", "Exhaustive", "TUNERS", "run", "trials_to_within", "Table", "replay", "replay_change"]
