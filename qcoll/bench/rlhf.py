"""``qcoll-bench rlhf``: RLHF iterations (DeepSpeed-Chat's step 3) of a sharded HF decoder, ZeRO-3 against ZeRO++.

Each iteration (:mod:`qcoll.bench.rlhf_loop`): every rank's actor samples
``--rollout-tokens`` new tokens for its ``--prompts`` seeded random prompts
(*generation*); the reward (share of even token ids), the actor's and the frozen, also
sharded, reference model's log-probabilities, the KL penalty and the advantages
(*scoring*); then ``--ppo-epochs`` PPO steps of the actor on its rollouts (*training*;
Adam, no critic). Modes (actor and reference alike):

- ``zero3``: ``ZeroConfig.zero3()`` (fp32 gathers over the world, fp32 reduce-scatter);
- ``zeropp``: ``ZeroConfig(weight_bits=--weight-bits, hpz=True, grad_bits=--grad-bits)``;
- ``zeropp-gen``: the same, with the actor's generation and scoring forwards inside
  ``generation_mode(max_cached_bytes=--max-cached-mib)``;
- ``zero3-gen``: ZeRO-3 with the same generation cache: the actor's weights gathered once per
  generation and kept (within ``--max-cached-mib``), as DeepSpeed-Chat's hybrid engine runs
  ZeRO-3, so that ``zeropp-gen`` against it is ZeRO++'s own contribution, not the cache's.

Every mode starts from the same model and runs the same prompts and sampling seeds, so a
``-gen`` mode and the mode without it (the same weights) must sample the same rollouts; the
table says whether they did. Per mode: ``--warmup`` untimed iterations, then ``--iters``
timed ones; per iteration the slowest rank's seconds of each part, qcoll's cross-node bytes
summed over the ranks (per part), inside ``qcoll-bench cluster`` the bytes that crossed the
node links, and the mean reward over all ranks' rollouts.

JSON (``--json FILE``): ``{"command": "rlhf", "world", "ranks_per_node", "args", "model",
"runs": [{"mode", "config", "generation_mode", "iterations": [{"seconds": {"generation",
"scoring", "training", "total"}, "inter_bytes": {part: bytes}, "link_bytes", "reward",
"loss"}], "mean_seconds": {part: s}, "speedup_vs_zero3", "tokens_per_s", "generation":
<GenerationStats.summary() of the last timed iteration or null>, "memory": {"gathered_peak",
"cached_bytes"}, "rollouts_match_zeropp", "rollouts_match_base", "speedup_vs_zero3_gen"}]}``
(``rollouts_match_base``: a ``-gen`` mode's rollouts against its mode without the cache).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch.distributed as dist

from . import cli, progress
from .hf_decoder import add_cache_option, add_model_options, build_decoder, cache_bytes, check_command
from .linkmeter import LinkWindow, summed
from .ranks import run_ranks
from . import rlhf_loop as loop

NAME = "rlhf"
MODES = {"zero3": (False, False), "zeropp": (True, False), "zeropp-gen": (True, True),
         "zero3-gen": (False, True)}  # (quantized, generation mode)
PARTS = ("generation", "scoring", "training")


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="RLHF (PPO) iterations of a sharded HF decoder: ZeRO-3 vs ZeRO++",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                   help=f"runs, of {' '.join(MODES)} (default all)")
    p.add_argument("--weight-bits", type=int, default=8, choices=[8, 6, 4], help="qwZ bits of zeropp (default 8)")
    p.add_argument("--grad-bits", type=int, default=4, choices=[8, 4, 2], help="qgZ bits of zeropp (default 4)")
    p.add_argument("--prompts", type=cli.positive_int, default=4, help="prompts per rank (default 4)")
    p.add_argument("--prompt-len", type=cli.positive_int, default=8, help="prompt tokens (default 8)")
    p.add_argument("--rollout-tokens", type=cli.positive_int, default=16,
                   help="new tokens sampled per prompt (default 16)")
    p.add_argument("--ppo-epochs", type=cli.positive_int, default=1, help="PPO steps per iteration (default 1)")
    p.add_argument("--kl-coef", type=float, default=0.1, help="KL penalty coefficient (default 0.1)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip (default 0.2)")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam learning rate of the actor (default 3e-4)")
    add_cache_option(p)
    add_model_options(p, d_model=128, vocab=4096)
    cli.add_common_options(p, iters=3, warmup=1)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_command(parser, args)
    if args.prompts < 2:
        parser.error(f"--prompts must be >= 2 (the advantages subtract the batch mean), got {args.prompts}")
    for name in ("kl_coef", "clip", "lr"):
        value = getattr(args, name)
        if not value >= 0 or value == float("inf") or (name != "kl_coef" and value == 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite {'non-negative' if name == 'kl_coef' else 'positive'}"
                         f" number, got {value}")
    with progress.starting(NAME, args.world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


def _config(args, mode: str):
    from .. import zero

    quantized, _ = MODES[mode]
    if not quantized:
        return zero.ZeroConfig.zero3()
    return zero.ZeroConfig(weight_bits=args.weight_bits, hpz=True, grad_bits=args.grad_bits)


class _Parts:
    """Seconds and qcoll's cross-node bytes of each part of one iteration, on this rank."""

    def __init__(self):
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.inter = dict.fromkeys(PARTS, 0)

    @contextlib.contextmanager
    def part(self, name: str):
        from ..comm.stats import stats

        b0, t0 = stats.total_inter_bytes, time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - t0
        self.inter[name] += stats.total_inter_bytes - b0


def _iteration(args, it: int, rank: int, actor, ref, opt, scope) -> tuple[_Parts, dict]:
    parts = _Parts()
    prompts = loop.prompts_for(args.seed, it, rank, args.prompts, args.prompt_len, args.vocab)
    with parts.part("generation"), scope() as gen:
        sequences = loop.rollout(actor, prompts, args.rollout_tokens, loop.sample_seed(args.seed, it, rank))
    with parts.part("scoring"):
        exp = loop.score(actor, ref, sequences, args.prompt_len, args.kl_coef, actor_scope=scope())
    losses = []
    with parts.part("training"):
        for _ in range(args.ppo_epochs):
            loss = loop.ppo_loss(actor, exp, args.clip)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
    return parts, {"sequences": sequences, "reward": float(exp.reward.mean()), "loss": losses[-1], "gen": gen}


def _run_mode(args, mode: str, topo, plain, link: LinkWindow, prog=None) -> tuple[dict, list]:
    """One mode's iterations; ``prog`` (a :class:`qcoll.bench.progress.Steps`) counts them as they finish."""
    from .. import zero

    config = _config(args, mode)
    _, in_mode = MODES[mode]
    actor = zero.shard(copy.deepcopy(plain), topo, config)
    ref = copy.deepcopy(plain).requires_grad_(False)
    ref = zero.shard(ref, topo, config)
    opt = zero.Optimizer(actor, torch.optim.Adam, lr=args.lr)
    budget = cache_bytes(args)

    def scope():
        return actor.generation_mode(max_cached_bytes=budget) if in_mode else contextlib.nullcontext()

    iterations, sequences, gen = [], [], None
    for it in range(args.warmup + args.iters):
        with link.window() as box:
            parts, out = _iteration(args, it, topo.rank, actor, ref, opt, scope)
        if prog is not None:
            prog.update(it + 1)
        sequences.append(out["sequences"])
        if it < args.warmup:
            continue
        seconds = torch.tensor([parts.seconds[p] for p in PARTS], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)   # the slowest rank's
        inter = summed([parts.inter[p] for p in PARTS])
        reward = torch.tensor([out["reward"], out["loss"]], dtype=torch.float64)
        dist.all_reduce(reward)
        iterations.append({
            "seconds": {**dict(zip(PARTS, seconds.tolist())), "total": box["seconds"]},
            "inter_bytes": dict(zip(PARTS, inter)), "link_bytes": box["bytes"],
            "reward": float(reward[0]) / topo.world_size, "loss": float(reward[1]) / topo.world_size})
        gen = out["gen"]
    mean = {p: statistics.mean(i["seconds"][p] for i in iterations) for p in (*PARTS, "total")}
    tokens = topo.world_size * args.prompts * args.rollout_tokens
    report = zero.memory_report(actor)
    run = {"mode": mode, "config": {"weight_bits": config.weight_bits, "hpz": config.hpz, "grad_bits": config.grad_bits},
           "generation_mode": in_mode, "iterations": iterations, "mean_seconds": mean,
           "tokens_per_s": tokens / mean["generation"],
           "generation": gen.summary() if gen is not None else None,
           "memory": {"gathered_peak": report["gathered_peak"],
                      "cached_bytes": gen.cached_bytes if gen is not None else 0}}
    return run, sequences


def _rank_main(args) -> None:
    from ..comm import Topology

    topo = Topology(args.ranks_per_node)
    plain = build_decoder(args, args.prompt_len + args.rollout_tokens + 8)
    link = LinkWindow(topo.rank)
    runs, rollouts = [], {}
    with progress.Steps(NAME, enabled=topo.rank == 0) as prog:
        for k, mode in enumerate(args.modes, 1):
            prog.begin(f"{mode} ({k}/{len(args.modes)})" if len(args.modes) > 1 else mode, args.warmup + args.iters,
                       unit="iteration")
            run, rollouts[mode] = _run_mode(args, mode, topo, plain, link, prog)
            prog.end()
            runs.append(run)
    base = next((r for r in runs if r["mode"] == "zero3"), None)
    base_gen = next((r for r in runs if r["mode"] == "zero3-gen"), None)
    for r in runs:
        r["speedup_vs_zero3"] = base["mean_seconds"]["total"] / r["mean_seconds"]["total"] if base else None
        r["speedup_vs_zero3_gen"] = (base_gen["mean_seconds"]["total"] / r["mean_seconds"]["total"]
                                     if base_gen else None)
        r["rollouts_match_base"] = _same_rollouts(rollouts, r["mode"])
        r["rollouts_match_zeropp"] = r["rollouts_match_base"] if r["mode"] == "zeropp-gen" else None
    if topo.rank != 0:
        return
    params = sum(p.numel() for p in plain.parameters())
    print(format_table(runs, args, params, topo), flush=True)
    if args.json:
        keys = ("modes", "weight_bits", "grad_bits", "prompts", "prompt_len", "rollout_tokens", "ppo_epochs",
                "kl_coef", "clip", "lr", "max_cached_mib", "arch", "layers", "d_model", "heads", "vocab", "seed",
                "warmup", "iters")
        cli.write_json(args.json, {"command": NAME, "world": topo.world_size, "ranks_per_node": topo.ranks_per_node,
                                   "args": {k: getattr(args, k) for k in keys},
                                   "model": {"arch": args.arch, "params": params}, "runs": runs})


def _same_rollouts(rollouts: dict, mode: str) -> bool | None:
    """For a ``-gen`` mode run beside its mode without the cache: whether every rank sampled the same
    rollouts in both (a collective: every rank calls it for the same modes); None otherwise."""
    plain = mode[: -len("-gen")] if mode.endswith("-gen") else None
    if plain not in rollouts or mode not in rollouts:
        return None
    same = torch.tensor([all(torch.equal(a, b) for a, b in zip(rollouts[plain], rollouts[mode]))], dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.2f}"


def format_table(runs: list[dict], args, params: int, topo) -> str:
    linked = any(i["link_bytes"] is not None for r in runs for i in r["iterations"])
    head = (f"{'mode':>10} {'s/iter':>7} {'vs zero3':>8} {'gen s':>7} {'score s':>7} {'train s':>7} "
            f"{'tok/s':>7} {'inter MB':>9} {'gen MB':>7} {'train MB':>8}")
    head += f" {'link MB':>8}" if linked else ""
    head += f" {'reward':>7} {'cache MB':>8} {'same':>5}"
    lines = [f"RLHF iterations: {topo.world_size} ranks = {topo.num_nodes} nodes x {topo.ranks_per_node}, "
             f"{args.arch} {args.layers}x{args.d_model} ({params / 1e6:.2f} M params), {args.prompts} prompts x "
             f"{args.rollout_tokens} tokens per rank, {args.ppo_epochs} PPO epoch(s); means over {args.iters} "
             "iteration(s); MB: cross-node, per iteration, summed over ranks", head]
    for r in runs:
        m, its = r["mean_seconds"], r["iterations"]
        inter = {p: statistics.mean(i["inter_bytes"][p] for i in its) for p in PARTS}
        line = (f"{r['mode']:>10} {m['total']:>7.2f} {r['speedup_vs_zero3'] or 0:>8.2f} {m['generation']:>7.2f} "
                f"{m['scoring']:>7.2f} {m['training']:>7.2f} {r['tokens_per_s']:>7.1f} {_mb(sum(inter.values())):>9} "
                f"{_mb(inter['generation']):>7} {_mb(inter['training']):>8}")
        if linked:
            line += f" {_mb(statistics.mean(i['link_bytes'] for i in its)):>8}"
        same = {True: "yes", False: "NO", None: "-"}[r["rollouts_match_base"]]
        line += f" {its[-1]['reward']:>7.3f} {_mb(r['memory']['cached_bytes']):>8} {same:>5}"
        lines.append(line)
    gen = next((r for r in runs if r["mode"] == "zero3-gen"), None)
    if gen is not None:
        lines.append("vs zero3-gen: " + ", ".join(f"{r['mode']} {r['speedup_vs_zero3_gen']:.2f}x" for r in runs))
    lines.append("same: a -gen mode sampled the same rollouts as its mode without the cache (the same weights); "
                 "reward: share of "
                 "even token ids in the responses, last iteration; cache MB: generation_mode's kept weights per rank")
    return "\n".join(lines)
