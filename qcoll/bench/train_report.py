"""``qcoll-bench train``'s report: the table (with the memory per rank), the adaptive runs' steps, where the
time goes, and the loss plot. :mod:`qcoll.bench.train` prints them from its runs' dicts (its JSON ``runs``).
"""
from __future__ import annotations

from . import plot


def format_adaptive(r: dict) -> str:
    """An adaptive-batch run (``--adaptive-batch``) step by step: loss, cosine, batch, learning rate, ms."""
    lines = [f"{r['mode']}: {'step':>5} {'loss':>7} {'cosine':>7} {'batch':>6} {'lr':>9} {'ms':>8}"]
    pad = " " * (len(r["mode"]) + 2)
    for i, (loss, cos, b, lr, sec) in enumerate(zip(r["losses"], r["cosines"], r["batches"], r["lrs"],
                                                    r["step_seconds"])):
        lines.append(f"{pad}{i + 1:>5} {loss:>7.3f} {cos:>7.3f} {b:>6} {lr:>9.2e} {sec * 1e3:>8.1f}")
    return "\n".join(lines)


def memory_kib(memory: dict) -> tuple[float | None, float | None]:
    """(state, peak) KiB per rank from a run's ``memory``, or (None, None) without one (adaptive runs).

    qcoll.zero's :func:`~qcoll.zero.memory_report`: state = fp32 master shards (with the
    block-aligned padding), their gradients and the optimizer's state after a step; peak adds
    the hpZ secondary shards held at the end of the forward and the most gathered parameters
    held at once during the run (the sum of two maxima: an upper bound). FSDP2's
    (:mod:`qcoll.bench.fsdp_runs`): state = the local shards (``to_local()``) of the
    parameters, gradients and AdamW state; peak adds the most unsharded parameters,
    post-forward shards and all-gather outputs in flight held at once (sampled in every FSDP
    module's forward and backward)."""
    if not memory:
        return None, None
    if "state" in memory:
        return memory["state"] / 1024, memory["peak"] / 1024
    state = memory.get("master", 0) + memory.get("grad", 0) + memory.get("optimizer_state", 0)
    return state / 1024, (state + memory.get("secondary_peak", 0) + memory.get("gathered_peak", 0)) / 1024


def format_table(runs: list[dict]) -> str:
    """The table of runs, one row per mode, and its legend."""
    metered = any(r.get("link_bytes_per_step") is not None for r in runs)
    targeted = any(r.get("steps_to_target") is not None for r in runs)
    peered = any(r.get("speedup_vs_best_peer") for r in runs)
    w = max([10] + [len(r["mode"]) for r in runs])
    head = (f"{'mode':>{w}} {'step(ms)':>9} {'tokens/s':>9} {'loss0':>7} {'loss':>7} {'intra/step':>11} "
            f"{'inter/step':>11} {'coll/step':>9} {'state_KiB':>9} {'peak_KiB':>9} {'speedup':>8} {'inter_x':>8}")
    if peered:
        head += f" {'vs_best':>8}"
    if metered:
        head += f" {'link/step':>11} {'link_x':>7}"
    if targeted:
        head += f" {'samples>tgt':>11} {'s>tgt':>7}"
    lines = [head]
    for r in runs:
        sp = f"{r['speedup_vs_zero3']:.2f}" if r["speedup_vs_zero3"] else "-"
        ir = f"{r['inter_ratio_vs_zero3']:.3f}" if r["inter_ratio_vs_zero3"] is not None else "-"
        intra = r["intra_bytes_per_step"] if r["intra_bytes_per_step"] is not None else "-"
        colls = r.get("collectives_per_step")
        state, peak = memory_kib(r.get("memory"))
        line = (f"{r['mode']:>{w}} {r['step_time_s'] * 1e3:>9.1f} {r['tokens_per_s']:>9.0f} "
                f"{r['first_loss']:>7.3f} {r['final_loss']:>7.3f} {intra:>11} "
                f"{r['inter_bytes_per_step']:>11} {colls if colls is not None else '-':>9} "
                f"{f'{state:.0f}' if state is not None else '-':>9} {f'{peak:.0f}' if peak is not None else '-':>9} "
                f"{sp:>8} {ir:>8}")
        if peered:
            vb = r.get("speedup_vs_best_peer")
            line += f" {f'{vb:.2f}' if vb else '-':>8}"
        if metered:
            lr = r.get("link_ratio_vs_zero3")
            line += f" {round(r['link_bytes_per_step'] or 0):>11} {f'{lr:.3f}' if lr is not None else '-':>7}"
        if targeted:
            n, sec = r.get("samples_to_target"), r.get("time_to_target_s")
            line += f" {n if n is not None else '-':>11} {f'{sec:.1f}' if sec is not None else '-':>7}"
        lines.append(line)
    lines.append("state_KiB: this rank's parameter shards, gradients and AdamW state after a step; peak_KiB: "
                 "state plus the most gathered parameters (gathers in flight included) and hpZ / post-forward shards "
                 "held at once (bytes of live tensors; activations, unsharded gradients and the quantized wire "
                 "buffers not counted)")
    best = next((r["best_peer"] for r in runs if r.get("best_peer")), None)
    if peered and best:
        lines.append(f"coll/step: collectives each rank issues per timed step; vs_best: speed-up vs the fastest "
                     f"peer ({best})")
    return "\n".join(lines)


def format_profile(runs: list[dict]) -> str:
    """Where each run's step goes (``where_time_goes``): phases and the waits for the transport."""
    lines = ["where the time goes (ms per step, mean of the ranks' medians; blocked: waiting for the transport)"]
    for r in runs:
        p = r.get("where_time_goes")
        if not p:
            continue
        blocked = ", ".join(f"{op} {s * 1e3:.1f}" for op, s in p["blocked_s"].items() if s >= 5e-4) or "-"
        lines.append(f"  {r['mode']}: forward {p['forward_s'] * 1e3:.1f}, backward {p['backward_s'] * 1e3:.1f}, "
                     f"optimizer {p['optimizer_s'] * 1e3:.1f}; blocked: {blocked}")
    return "\n".join(lines)


def plot_losses(runs: list[dict], path: str) -> None:
    """``--plot``: the loss curves (with adaptive runs also their batch and cosine per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    adaptive_runs = [r for r in runs if "cosines" in r]
    fig, axes = plt.subplots(1, 3 if adaptive_runs else 1, figsize=(14 if adaptive_runs else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    for r in runs:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["mode"], linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch)")
    ax.set_title("char transformer on the Python stdlib sources")
    ax.legend()
    ax.grid(alpha=0.3)
    for ax, key, label in ((axes[0][1], "batches", "global batch (sequences)"),
                           (axes[0][2], "cosines", "half-batch gradient cosine")) if adaptive_runs else ():
        for r in adaptive_runs:
            ax.plot(range(1, len(r[key]) + 1), r[key], label=r["mode"], linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    plot.save_figure(fig, path)
    plt.close(fig)
