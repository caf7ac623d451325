"""ZeRO++ against ZeRO-3 at the default weight block (issue 17): pre-training, 2-bit fine-tuning, plateau escapes.

Run: python bench/convergence_sweep.py --json bench/convergence_sweep.json
     python bench/convergence_sweep.py --feedback --json bench/convergence_feedback.json
     python bench/convergence_sweep.py --plateau --json bench/convergence_plateau.json
     python bench/convergence_sweep.py --controls --json bench/convergence_controls.json

4 ranks = 2 nodes x 2 (gloo, one host), every run on the same batches of the Python standard
library's sources, AdamW (no weight decay). Two models: ``char``, the convergence test's
character transformer (4 layers, d 128, 4 heads, context 64, tied embedding), and ``llama``,
a decoder built from ``transformers.LlamaConfig`` (4 layers, hidden 128, 4 heads, intermediate
344, vocabulary 256 = bytes, untied head; loss = the model's causal LM loss with ``labels``;
no downloads), both on the same byte-level text.

Default mode, per model: ZeRO-3 from init seeds A and B (their difference is the run-to-run
noise), then ZeRO++ (hpZ, 4-bit gradients in blocks of 128) with 8/6/4-bit weights at block
256 from seed A, and the 4-bit row again with stochastic gradient rounding (``--sr-bits``).
The score is the mean loss of the last ``--tail`` steps at the convergence test's horizon
(``--test-steps``) and at the end (``--steps``); ratios are against ZeRO-3 seed A.
Then the 2-bit fine-tune: the final states of ZeRO-3 seeds A and B are the pre-trained models
(``qcoll.zero.save``); each fine-tune config loads one (``qcoll.zero.load`` reshards into any
config) with a fresh AdamW (``--ft-lr``) and trains ``--ft-steps`` on the *next* megabyte of
the sources (other files), same batches for all: ZeRO-3 from A and from B (the fine-tune's
seed noise), 4-bit and 2-bit weights from A (block 256, hpZ, 4-bit gradients). Reported: the
loss of the first fine-tune batch (the pre-trained weights as the config gathers them) and the
mean of the last ``--tail`` fine-tune losses.

``--plateau``: the old convergence test's setup (char model, lr 2e-3, 120 steps), for init
seeds x batch seeds; per configuration the step at which the 10-step mean loss first falls
below ``--escape-loss`` (leaving the plateau near the unigram loss), runs stop there.
``--feedback``: qgZ at 2 bits with error feedback (issue 40) against ZeRO-3's seed noise, pre-training
``--steps`` on both models: ZeRO-3 from seeds A and B, then from seed A 2-bit gradients without and
with error feedback (8-bit weights), with feedback and 4-bit weights, and with feedback at 8 bits
inside the node and 2 across (``grad_bits=(8, 2)``); each row's cross-node bytes per step
(``qcoll.comm.stats``, rank 0) beside its loss.
``--controls``: the convergence test's setup and score (lr 1e-3, mean of steps 161-200)
for configurations that should fail or might: 2-bit weights from scratch, 2-bit gradients,
4-bit weights in 4096-element blocks, and two injected bugs (the gradient reduction keeps
each rank's own gradient, no communication; rank 0's gradient scaled x4 before qgZ).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import qcoll
from qcoll import zero
from qcoll.bench.cli import write_json
from qcoll.bench.ranks import run_ranks
from qcoll.testing import (Batches, CharTransformer, TransformerConfig, byte_llama, causal_lm_loss, stdlib_bytes,
                           train_steps)

MB = 1 << 20
CHAR = TransformerConfig(context=64, d_model=128, n_layers=4, n_heads=4)


def _build(name: str, seed: int):
    """(module, units, loss_fn(module, x, y))."""
    if name == "char":
        torch.manual_seed(seed)
        model = CharTransformer(CHAR)
        return model, model.units(), lambda m, x, y: m(x, y)
    return byte_llama(CHAR.context, seed), None, causal_lm_loss


def _cfg(weight_bits, grad_bits=4, sr=False, block=256, feedback=False, beta=0.0) -> zero.ZeroConfig:
    if weight_bits is None and grad_bits is None:
        return zero.ZeroConfig.zero3()
    return zero.ZeroConfig(weight_bits=weight_bits, hpz=weight_bits is not None, grad_bits=grad_bits,
                           weight_block=block, stochastic_grad_rounding=sr, grad_error_feedback=feedback,
                           grad_feedback_beta=beta)


def _install_bug(kind: str | None):
    """Negative controls: replace the ZeRO layer's gradient reduction (``--controls`` only)."""
    import qcoll.zero.flat as flat

    if not hasattr(flat, "_real_reduce"):
        flat._real_reduce = flat.reduce_scatter_quantized
    real = flat._real_reduce

    class Done:
        def wait(self):
            return None

    def local_only(out, full, **kw):  # no communication: each rank keeps its own micro-batch's gradient
        r, n = dist.get_rank(), out.numel()
        out.copy_(full[r * n:(r + 1) * n])
        return Done()

    def rank0_x4(out, full, **kw):
        return real(out, full * 4 if dist.get_rank() == 0 else full, **kw)

    flat.reduce_scatter_quantized = {None: real, "local-grad": local_only, "rank0-grad-x4": rank0_x4}[kind]


def _train(a, topo, model_name, config, seed, steps, lr, data, batch_seed, load=None, save=None,
           stop_below=None, bug=None) -> dict:
    _install_bug(bug)
    model, units, loss_fn = _build(model_name, seed)
    m = zero.shard(model, topo, config, units=units)
    if load:
        zero.load(load, m)
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=lr, weight_decay=0.0)
    batches = Batches(data, a.batch, CHAR.context, batch_seed)

    def below(i, losses):  # the mean of the last 10 losses is under stop_below: done
        return stop_below is not None and len(losses) >= 10 and sum(losses[-10:]) / 10 < stop_below

    from qcoll.comm import stats
    inter0 = stats.stats.total_inter_bytes
    t0 = time.perf_counter()
    losses = train_steps(m, opt, batches, steps, rank=dist.get_rank(), world=dist.get_world_size(), loss_fn=loss_fn,
                         after_step=below)
    wall = time.perf_counter() - t0
    inter = (stats.stats.total_inter_bytes - inter0) / max(len(losses), 1)
    if save:
        zero.save(save, m)
    _install_bug(None)
    return {"losses": losses, "wall_s": wall, "inter_bytes_per_step": inter}


def _tail(losses, end, n):
    return sum(losses[end - n:end]) / n if len(losses) >= end else None


def _say(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _config_dict(c: zero.ZeroConfig) -> dict:
    d = dataclasses.asdict(c)
    d["compute_dtype"] = str(d["compute_dtype"])
    return d


def _sweep(a, topo, out):
    pre, ft_data = stdlib_bytes(MB), stdlib_bytes(2 * MB)[MB:]
    tmp = [tempfile.mkdtemp(prefix="qcoll-conv-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp)
    try:
        for model in a.models:
            rows = [("zero3", "ZeRO-3", _cfg(None, None), a.seeds[0]), ("zero3-seedB", "ZeRO-3", _cfg(None, None), a.seeds[1])]
            for bits in a.bits:
                rows.append((f"w{bits}g4", f"ZeRO++ {bits}/4", _cfg(bits), a.seeds[0]))
                if bits in a.sr_bits:
                    rows.append((f"w{bits}g4-sr", f"ZeRO++ {bits}/4, stochastic grads", _cfg(bits, sr=True), a.seeds[0]))
            ckpt = os.path.join(tmp[0], f"{model}-pretrained")
            for key, label, config, seed in rows:
                r = _train(a, topo, model, config, seed, a.steps, a.lr, pre, a.batch_seed,
                           save={"zero3": f"{ckpt}-A", "zero3-seedB": f"{ckpt}-B"}.get(key))
                out["runs"].append({"model": model, "phase": "pretrain", "key": key, "label": label, "seed": seed,
                                    "config": _config_dict(config), **r})
                _say(f"{model:5s} {key:12s} seed {seed}: {r['wall_s']:6.1f}s  test-horizon "
                     f"{_tail(r['losses'], a.test_steps, a.tail):.4f}  final {_tail(r['losses'], a.steps, a.tail):.4f}")
            ft = [("ft-zero3", "ZeRO-3", _cfg(None, None), "A"), ("ft-zero3-seedB", "ZeRO-3", _cfg(None, None), "B")]
            ft += [(f"ft-w{b}g4", f"ZeRO++ {b}/4", _cfg(b), "A") for b in a.ft_bits]
            for key, label, config, source in ft:
                r = _train(a, topo, model, config, a.seeds[0], a.ft_steps, a.ft_lr, ft_data, a.ft_batch_seed,
                           load=f"{ckpt}-{source}")
                out["runs"].append({"model": model, "phase": "finetune", "key": key, "label": label,
                                    "pretrained": f"ZeRO-3 seed {a.seeds[0] if source == 'A' else a.seeds[1]}",
                                    "config": _config_dict(config), **r})
                _say(f"{model:5s} {key:15s} from {source}: {r['wall_s']:6.1f}s  first {r['losses'][0]:.4f}  "
                     f"final {_tail(r['losses'], a.ft_steps, a.tail):.4f}")
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)


def _plateau(a, topo, out):
    data = stdlib_bytes(MB)
    configs = [("zero3", _cfg(None, None))]
    configs += [(f"w{b}g4{'-sr' if sr else ''}", _cfg(b, sr=sr)) for b in (8, 4) for sr in (False, True)]
    configs += [(f"g4{'-sr' if sr else ''}", _cfg(None, 4, sr=sr)) for sr in (False, True)]
    configs += [("w8", _cfg(8, None)), ("g8", _cfg(None, 8))]
    for seed in a.seeds:
        for bseed in a.plateau_batch_seeds:
            for key, config in configs:
                r = _train(a, topo, "char", config, seed, a.plateau_steps, a.plateau_lr, data, bseed,
                           stop_below=a.escape_loss)
                esc = len(r["losses"]) if sum(r["losses"][-10:]) / 10 < a.escape_loss else None
                out["runs"].append({"model": "char", "phase": "plateau", "key": key, "seed": seed, "batch_seed": bseed,
                                    "config": _config_dict(config), "escape_step": esc, **r})
                _say(f"init {seed} batches {bseed} {key:8s}: escape step {esc}  ({r['wall_s']:.1f}s)")


def _feedback(a, topo, out):
    data = stdlib_bytes(MB)
    for model in a.models:
        rows = [("zero3", "ZeRO-3", _cfg(None, None), a.seeds[0]), ("zero3-seedB", "ZeRO-3", _cfg(None, None), a.seeds[1]),
                ("w8g2", "ZeRO++ 8/2", _cfg(8, 2), a.seeds[0]),
                ("w8g2-ef", "ZeRO++ 8/2, error feedback", _cfg(8, 2, feedback=True), a.seeds[0]),
                ("w4g2-ef", "ZeRO++ 4/2, error feedback", _cfg(4, 2, feedback=True), a.seeds[0]),
                ("w4g82-ef", "ZeRO++ 4/(8 in, 2 across), error feedback", _cfg(4, (8, 2), feedback=True), a.seeds[0]),
                ("w8g2-loco", "ZeRO++ 8/2, LoCo feedback (beta 0.8)", _cfg(8, 2, feedback=True, beta=0.8), a.seeds[0]),
                ("w4g2-loco", "ZeRO++ 4/2, LoCo feedback (beta 0.8)", _cfg(4, 2, feedback=True, beta=0.8), a.seeds[0])]
        for key, label, config, seed in rows:
            if a.only and key not in a.only:
                continue
            r = _train(a, topo, model, config, seed, a.steps, a.lr, data, a.batch_seed)
            out["runs"].append({"model": model, "phase": "pretrain", "key": key, "label": label, "seed": seed,
                                "config": _config_dict(config), **r})
            _say(f"{model:5s} {key:12s} seed {seed}: {r['wall_s']:6.1f}s  final {_tail(r['losses'], a.steps, a.tail):.4f}"
                 f"  {r['inter_bytes_per_step']:.0f} cross-node B/step")


def _controls(a, topo, out):
    data = stdlib_bytes(MB)
    rows = [("zero3", _cfg(None, None), None), ("w2g4", _cfg(2), None), ("w8g2", _cfg(8, 2), None),
            ("w4g4-block4096", _cfg(4, block=4096), None), ("w8g4+local-grad", _cfg(8), "local-grad"),
            ("w8g4+rank0-grad-x4", _cfg(8), "rank0-grad-x4")]
    for key, config, bug in rows:
        r = _train(a, topo, "char", config, a.seeds[0], a.test_steps, a.lr, data, a.batch_seed, bug=bug)
        out["runs"].append({"model": "char", "phase": "controls", "key": key, "seed": a.seeds[0], "bug": bug,
                            "config": _config_dict(config), **r})
        _say(f"{key:20s}: score {_tail(r['losses'], a.test_steps, a.tail):.4f}  ({r['wall_s']:.1f}s)")


def _rank_main(a):
    topo = qcoll.Topology(a.ranks_per_node)
    out = {"command": "convergence_sweep", "world": topo.world_size, "ranks_per_node": topo.ranks_per_node,
           "args": vars(a), "runs": []}
    t0 = time.perf_counter()
    if a.merge:
        import json
        with open(a.merge) as f:
            out["runs"] += json.load(f)["runs"]
    {"sweep": _sweep, "plateau": _plateau, "controls": _controls, "feedback": _feedback}[a.mode](a, topo, out)
    out["total_wall_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        if a.json:   # first: a report that fails must not lose the runs
            write_json(a.json, out)
        print(report(out), flush=True)


def _ratio(x, base):
    return f"{x / base:.3f}" if x is not None and base else "-"


def _within(is_noise_row: bool, v: float, base: float, noise: float) -> str:
    """The "within seed noise" cell: "(noise)" for ZeRO-3's own rows, else whether ``v`` is within
    ``noise`` (relative) of ``base``."""
    if is_noise_row:
        return "(noise)"
    return "yes" if abs(v - base) <= noise * base else "no"


def _feedback_report(a: dict, runs: list) -> list[str]:
    lines = []
    for model in a["models"]:
        pre = {r["key"]: r for r in runs if r["model"] == model}
        n = a["steps"]
        if "zero3" not in pre or "zero3-seedB" not in pre:
            lines.append(f"{model}: no ZeRO-3 rows to compare with (merge the runs that have them: --merge)")
            continue
        base = _tail(pre["zero3"]["losses"], n, a["tail"])
        noise = abs(_tail(pre["zero3-seedB"]["losses"], n, a["tail"]) - base) / base
        zbytes = pre["zero3"]["inter_bytes_per_step"]
        lines += ["", f"{model}: {n} steps from scratch, mean loss of the last {a['tail']} steps",
                  "| config | seed | loss | vs ZeRO-3 | within seed noise | cross-node bytes/step | vs ZeRO-3 |",
                  "|---|---|---|---|---|---|---|"]
        for key, r in pre.items():
            v = _tail(r["losses"], n, a["tail"])
            within = _within(key.startswith("zero3"), v, base, noise)
            lines.append(f"| {r['label']} | {r['seed']} | {v:.4f} | {_ratio(v, base)} | {within} | "
                         f"{r['inter_bytes_per_step']:,.0f} | {_ratio(r['inter_bytes_per_step'], zbytes)} |")
        lines.append(f"ZeRO-3 seed noise |B - A| / A: {noise:.2%}")
    return lines


def report(out: dict) -> str:
    """The markdown tables of a result (also usable on a saved JSON: ``report(json.load(f))``)."""
    a, runs = out["args"], out["runs"]
    lines = []
    if a["mode"] == "feedback":
        lines += _feedback_report(a, runs)
    elif a["mode"] == "sweep":
        for model in a["models"]:
            pre = {r["key"]: r for r in runs if r["model"] == model and r["phase"] == "pretrain"}
            s1, s2 = a["test_steps"], a["steps"]
            base = {h: _tail(pre["zero3"]["losses"], h, a["tail"]) for h in (s1, s2)}
            noise = {h: abs(_tail(pre["zero3-seedB"]["losses"], h, a["tail"]) - base[h]) / base[h] for h in (s1, s2)}
            lines += ["", f"{model}: pre-training, mean loss of the last {a['tail']} steps at step {s1} and {s2}",
                      f"| config | seed | steps {s1 - a['tail'] + 1}-{s1} | vs ZeRO-3 | steps {s2 - a['tail'] + 1}-{s2} "
                      f"| vs ZeRO-3 | within seed noise (step {s2}) |", "|---|---|---|---|---|---|---|"]
            for key, r in pre.items():
                v = {h: _tail(r["losses"], h, a["tail"]) for h in (s1, s2)}
                within = _within(key.startswith("zero3"), v[s2], base[s2], noise[s2])
                lines.append(f"| {r['label']} | {r['seed']} | {v[s1]:.4f} | {_ratio(v[s1], base[s1])} | {v[s2]:.4f} "
                             f"| {_ratio(v[s2], base[s2])} | {within} |")
            lines.append(f"ZeRO-3 seed noise |B - A| / A: {noise[s1]:.2%} at step {s1}, {noise[s2]:.2%} at step {s2}")
            ft = {r["key"]: r for r in runs if r["model"] == model and r["phase"] == "finetune"}
            if ft:
                n = a["ft_steps"]
                fb = _tail(ft["ft-zero3"]["losses"], n, a["tail"])
                fnoise = abs(_tail(ft["ft-zero3-seedB"]["losses"], n, a["tail"]) - fb) / fb
                lines += ["", f"{model}: fine-tune from ZeRO-3's step-{s2} state, {n} steps at lr {a['ft_lr']:g} on other text",
                          f"| config | pre-trained by | first loss | mean of last {a['tail']} | vs ZeRO-3 | within noise |",
                          "|---|---|---|---|---|---|"]
                for key, r in ft.items():
                    v = _tail(r["losses"], n, a["tail"])
                    within = _within(key.startswith("ft-zero3"), v, fb, fnoise)
                    lines.append(f"| {r['label']} | {r['pretrained']} | {r['losses'][0]:.4f} | {v:.4f} | {_ratio(v, fb)} "
                                 f"| {within} |")
                lines.append(f"ZeRO-3 fine-tune seed noise |B - A| / A: {fnoise:.2%}")
    elif a["mode"] == "plateau":
        keys = list(dict.fromkeys(r["key"] for r in runs))
        cases = list(dict.fromkeys((r["seed"], r["batch_seed"]) for r in runs))
        esc = {(r["seed"], r["batch_seed"], r["key"]): r["escape_step"] for r in runs}
        lines += ["", f"Step at which the 10-step mean loss first falls below {a['escape_loss']} (lr {a['plateau_lr']:g}; "
                  f"'>{a['plateau_steps']}': not within the run)",
                  "| init seed, batch seed | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for c in cases:
            cells = [str(esc[(*c, k)]) if esc[(*c, k)] else f">{a['plateau_steps']}" for k in keys]
            lines.append(f"| {c[0]}, {c[1]} | " + " | ".join(cells) + " |")
        means = [sum(esc[(*c, k)] or a["plateau_steps"] + 1 for c in cases) / len(cases) for k in keys]
        lines.append("| mean (a miss counts as one past the run) | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    else:
        base = _tail(next(r for r in runs if r["key"] == "zero3")["losses"], a["test_steps"], a["tail"])
        lines += ["", f"The convergence test's score (mean of steps {a['test_steps'] - a['tail'] + 1}-{a['test_steps']}, "
                  f"lr {a['lr']:g}, seed {a['seeds'][0]}) and its 3% bound",
                  "| config | score | vs ZeRO-3 | passes the test's bound |", "|---|---|---|---|"]
        for r in runs:
            v = _tail(r["losses"], a["test_steps"], a["tail"])
            lines.append(f"| {r['key']} | {v:.4f} | {_ratio(v, base)} | {'yes' if abs(v - base) <= 0.03 * base else 'no'} |")
    lines.append(f"\ntotal wall time {out['total_wall_s']:.0f} s")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plateau", dest="mode", action="store_const", const="plateau", default="sweep")
    p.add_argument("--controls", dest="mode", action="store_const", const="controls")
    p.add_argument("--feedback", dest="mode", action="store_const", const="feedback")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["char", "llama"], choices=["char", "llama"])
    p.add_argument("--bits", type=int, nargs="+", default=[8, 6, 4], help="weight bits of the ZeRO++ rows")
    p.add_argument("--sr-bits", type=int, nargs="*", default=[4], help="weight bits that also get a stochastic-rounding row")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 1], help="init seeds A and B")
    p.add_argument("--batch-seed", type=int, default=7)
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--test-steps", type=int, default=200, help="the convergence test's horizon")
    p.add_argument("--tail", type=int, default=40)
    p.add_argument("--ft-steps", type=int, default=100)
    p.add_argument("--ft-lr", type=float, default=5e-4)
    p.add_argument("--ft-bits", type=int, nargs="+", default=[4, 2])
    p.add_argument("--ft-batch-seed", type=int, default=11)
    p.add_argument("--plateau-lr", type=float, default=2e-3)
    p.add_argument("--plateau-steps", type=int, default=120)
    p.add_argument("--plateau-batch-seeds", type=int, nargs="+", default=[7, 8])
    p.add_argument("--escape-loss", type=float, default=3.05)
    p.add_argument("--only", nargs="*", default=None, metavar="KEY", help="--feedback: run only these rows")
    p.add_argument("--merge", default=None, help="--feedback: the runs of an earlier JSON go first in the report")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.mode == "plateau" and a.seeds == [0, 1]:
        a.seeds = [0, 3]  # the init seeds whose ZeRO-3 run sits on the plateau longest (40-60 steps)
    run_ranks(_rank_main, a, a.nproc, a.ranks_per_node)


if __name__ == "__main__":
    main()
