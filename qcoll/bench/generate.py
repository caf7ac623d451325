"""``qcoll-bench generate``: greedy generation of a sharded Hugging Face decoder, ZeRO-3 against ZeRO++.

A small GPT-2 or Llama built from a config (random weights, no downloads) is
sharded once per mode and generates ``--tokens`` new tokens greedily (batch 1,
a seeded random prompt of ``--prompt-len`` tokens; ``min_new_tokens`` keeps the
count fixed). Modes:

- ``zero3``: ``ZeroConfig.zero3()`` (fp32 weights gathered over the world for every
  token), without the mode (without hpZ it would gather the same, as the tests check);
- ``zeropp``: ``ZeroConfig(weight_bits=--weight-bits, hpz=True)`` without the mode (qwZ
  gathers over the world for every token);
- ``zeropp-gen``: the same inside ``model.generation_mode(max_cached_bytes=--max-cached-mib)``:
  the first forward's qwZ gather keeps the groups that fit the budget gathered (every later
  forward gathers nothing) and the hpZ secondary shards of the others (every later forward
  gathers those inside the node).

Per mode: ``--warmup`` untimed generations of a few tokens, a 1-token generation
that gives the cross-node bytes of the first forward on the node links (inside
``qcoll-bench cluster``), then ``--iters`` timed generations (the median is
reported; seconds are the slowest rank's). Reported: tokens/s, the speed-up
over ``zero3`` and the ratio to the unsharded model generating on every rank at once
(``vs_unsharded``: the same ranks and cores, no communication); qcoll's byte counters summed over the ranks: inter-node bytes of
the first forward and per token after it, intra-node bytes per token; inside
``qcoll-bench cluster`` the bytes that crossed the node links (veth counters, the
barriers around each window measured alone and subtracted); and whether the
tokens equal the reference: the unsharded model (fp32) for ``zero3``, for the
quantized modes the unsharded model loaded with the qwZ-dequantized weights (the
exported quantized model). ``unsharded tokens/s`` is rank 0 generating alone
with the plain model, no communication: the compute floor.

JSON (``--json FILE``): ``{"command": "generate", "world", "ranks_per_node", "args",
"model": {"arch", "params"}, "unsharded_tokens_per_s", "unsharded_all_ranks_tokens_per_s", "runs": [{"mode", "config",
"generation_mode", "tokens", "seconds", "tokens_per_s", "speedup_vs_zero3", "forwards",
"inter_bytes_first_forward", "inter_bytes_per_token_after_first", "intra_bytes_first_forward",
"intra_bytes_per_token_after_first", "seconds_first_forward", "seconds_per_token_after_first",
"link_bytes_first_forward", "link_bytes_per_token_after_first", "link_bytes_total",
"reference", "tokens_match", "output_tokens", "cached_bytes_per_rank", "secondary_bytes_per_rank",
"vs_unsharded"}]}`` (``link_*`` null outside a cluster; bytes
summed over the ranks; ``*_after_first``: mean per forward after the first).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from . import cli, progress
from .ranks import run_ranks
from .hf_decoder import add_cache_option, add_model_options, build_decoder, cache_bytes, check_command
from .linkmeter import LinkWindow, summed

NAME = "generate"
MODES = {
    "zero3": (False, False),     # (quantized hpZ config, inside generation_mode)
    "zeropp": (True, False),
    "zeropp-gen": (True, True),
}
ARCHS = ("gpt2", "llama")
WARMUP_TOKENS = 4


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help="greedy generation of a sharded HF decoder: ZeRO-3 vs ZeRO++ generation mode",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", nargs="+", default=["zero3", "zeropp-gen"], choices=list(MODES), metavar="MODE",
                   help=f"runs, of {' '.join(MODES)} (default zero3 zeropp-gen)")
    p.add_argument("--weight-bits", type=int, default=8, choices=[8, 6, 4, 2],
                   help="qwZ weight bits of the zeropp modes (default 8)")
    p.add_argument("--tokens", type=cli.positive_int, default=64, help="new tokens per timed generation (default 64)")
    p.add_argument("--prompt-len", type=cli.positive_int, default=16, help="prompt tokens (default 16)")
    add_cache_option(p)
    add_model_options(p)
    cli.add_common_options(p, iters=1, warmup=1)
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_command(parser, args)
    with progress.starting(NAME, args.world):
        run_ranks(_rank_main, args, args.nproc, args.ranks_per_node)
    return 0


# ---------------------------------------------------------------------------- model
def build_model(args):
    """The plain decoder of the model options (eval mode, fp32), seeded by ``--seed``."""
    return build_decoder(args, args.prompt_len + args.tokens + 8).eval()


def _prompt(args) -> torch.Tensor:
    gen = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(2, args.vocab, (1, args.prompt_len), generator=gen)


def _generate(model, prompt, tokens: int) -> list[int]:
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                         min_new_tokens=tokens, do_sample=False)
    return out[0, prompt.shape[1]:].tolist()


def _config(args, mode: str):
    from .. import zero

    quantized, _ = MODES[mode]
    return zero.ZeroConfig(weight_bits=args.weight_bits, hpz=True, grad_bits=4) if quantized else zero.ZeroConfig.zero3()


def _reference(model, plain, quantized: bool):
    """The model the tokens are checked against, on rank 0 (None elsewhere; a collective): the
    unsharded fp32 model, or the quantized model written by ``export_quantized`` and loaded
    into a plain copy with ``load_quantized``."""
    from .. import weights, zero

    if not quantized:
        return plain if dist.get_rank() == 0 else None
    box = [tempfile.mkdtemp(prefix="qcoll-generate-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "model.safetensors")
    try:
        zero.export_quantized(model, path)
        return weights.load_quantized(path, copy.deepcopy(plain)) if dist.get_rank() == 0 else None
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(box[0], ignore_errors=True)


class _ForwardMeter:
    """Bytes and seconds of each call of the sharded model outside ``generation_mode()``, into a
    :class:`qcoll.zero.GenerationStats` (hooks outside qcoll's own, never-reset byte totals)."""

    def __init__(self, model):
        from .. import zero

        self.stats = zero.GenerationStats()
        self._hooks = [model.register_forward_pre_hook(self._pre, prepend=True),
                       model.register_forward_hook(self._post, always_call=True)]

    def _pre(self, module, args):
        from ..comm.stats import stats

        self._start = (stats.total_inter_bytes, stats.total_intra_bytes, time.perf_counter())

    def _post(self, module, args, output):
        from ..comm.stats import stats

        inter, intra, t0 = self._start
        self.stats._record(stats.total_inter_bytes - inter, stats.total_intra_bytes - intra,
                           time.perf_counter() - t0, 0)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


# ---------------------------------------------------------------------------- ranks
def _run_mode(args, mode: str, topo, plain, prompt, link: LinkWindow, references: dict, prog=None) -> dict:
    """One mode's generations; ``prog`` (a :class:`qcoll.bench.progress.Steps`) counts them as they finish."""
    from .. import zero

    done = prog.step if prog is not None else (lambda: None)

    quantized, in_mode = MODES[mode]
    config = _config(args, mode)
    model = zero.shard(copy.deepcopy(plain), topo, config)
    ref_key = ("quantized", config.weight_bits) if quantized else ("fp32",)
    if ref_key not in references:
        ref = _reference(model, plain, quantized)
        tokens = None
        if topo.rank == 0:
            with torch.no_grad():
                tokens = _generate(ref, prompt, args.tokens)
        references[ref_key] = tokens
        dist.barrier()

    budget = cache_bytes(args)

    def scope():
        return model.generation_mode(max_cached_bytes=budget) if in_mode else contextlib.nullcontext()

    for _ in range(args.warmup):
        with scope():
            _generate(model, prompt, min(args.tokens, WARMUP_TOKENS))
        done()
    with link.window() as first, scope():
        _generate(model, prompt, 1)
    done()
    times, outputs = [], []
    for _ in range(args.iters):
        meter = None if in_mode else _ForwardMeter(model)
        with link.window() as box, scope() as gen:
            outputs.append(_generate(model, prompt, args.tokens))
        done()
        if meter is not None:
            meter.remove()
            gen = meter.stats
        times.append(box["seconds"])
    seconds = statistics.median(times)
    inter = summed(gen.inter_node_bytes_per_forward)
    intra = summed(gen.intra_node_bytes_per_forward)
    after = max(1, len(inter) - 1)
    link_total = box["bytes"]
    link_first = first["bytes"]
    reference = references[ref_key]
    return {
        "mode": mode, "config": {"weight_bits": config.weight_bits, "hpz": config.hpz},
        "generation_mode": in_mode, "tokens": args.tokens, "seconds": seconds,
        "tokens_per_s": args.tokens / seconds, "forwards": gen.forwards,
        "inter_bytes_first_forward": inter[0], "inter_bytes_per_token_after_first": sum(inter[1:]) / after,
        "intra_bytes_first_forward": intra[0], "intra_bytes_per_token_after_first": sum(intra[1:]) / after,
        "seconds_first_forward": gen.seconds_per_forward[0],
        "seconds_per_token_after_first": sum(gen.seconds_per_forward[1:]) / after,
        "link_bytes_first_forward": link_first,
        "link_bytes_per_token_after_first": (None if link_total is None else
                                             (link_total - link_first) / after),
        "link_bytes_total": link_total,
        "reference": "exported quantized model" if quantized else "unsharded fp32 model",
        "tokens_match": None if reference is None else all(o == reference for o in outputs),
        "output_tokens": outputs[-1],
        "cached_bytes_per_rank": gen.cached_bytes,
        "secondary_bytes_per_rank": gen.secondary_bytes_peak,
    }


def _rank_main(args) -> None:
    from ..comm import Topology

    topo = Topology(args.ranks_per_node)
    with progress.Steps(NAME, enabled=topo.rank == 0) as prog:
        runs, plain, unsharded_tps, together_tps = _run_modes(args, topo, prog)
    for r in runs:
        r["vs_unsharded"] = r["tokens_per_s"] / together_tps
    if topo.rank != 0:
        return
    params = sum(p.numel() for p in plain.parameters())
    print(format_table(runs, unsharded_tps, together_tps, args, params, topo), flush=True)
    if args.json:
        cli.write_json(args.json, {
            "command": NAME, "world": topo.world_size, "ranks_per_node": topo.ranks_per_node,
            "args": {k: getattr(args, k) for k in ("modes", "weight_bits", "tokens", "prompt_len", "arch", "layers",
                                                    "d_model", "heads", "vocab", "seed", "warmup", "iters")},
            "model": {"arch": args.arch, "params": params}, "unsharded_tokens_per_s": unsharded_tps,
            "unsharded_all_ranks_tokens_per_s": together_tps, "runs": runs})


def _run_modes(args, topo, prog) -> tuple[list[dict], torch.nn.Module, float | None, float]:
    """The unsharded references and floors, then every mode (each a run of its generations in ``prog``):
    (runs, the plain model, rank 0's unsharded tokens/s or None, every rank's at once)."""
    prog.begin("the unsharded model (reference, compute floor)")
    plain = build_model(args)
    prompt = _prompt(args)
    link = LinkWindow(topo.rank)
    references, unsharded_tps = {}, None
    if topo.rank == 0:   # the fp32 reference, and the compute floor: rank 0 alone, no communication
        with torch.no_grad():
            _generate(plain, prompt, min(args.tokens, WARMUP_TOKENS))
            t0 = time.perf_counter()
            references[("fp32",)] = _generate(plain, prompt, args.tokens)
            unsharded_tps = args.tokens / (time.perf_counter() - t0)
    else:
        references[("fp32",)] = None
    with link.window() as together, torch.no_grad():  # every rank its own unsharded copy at once: the same ranks'
        _generate(plain, prompt, args.tokens)          # floor, sharing the cores as the sharded modes do
    together_tps = args.tokens / together["seconds"]
    runs = []
    for k, mode in enumerate(args.modes, 1):
        label = f"{mode} ({k}/{len(args.modes)})" if len(args.modes) > 1 else mode
        prog.begin(label, args.warmup + 1 + args.iters, unit="generation")
        runs.append(_run_mode(args, mode, topo, plain, prompt, link, references, prog))
        prog.end()
    base = next((r for r in runs if r["mode"] == "zero3"), None)
    for r in runs:
        r["speedup_vs_zero3"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
    return runs, plain, unsharded_tps, together_tps


def _num(v, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def format_table(runs: list[dict], unsharded_tps, together_tps, args, params: int, topo) -> str:
    linked = any(r["link_bytes_total"] is not None for r in runs)
    head = (f"{'mode':>10} {'bits':>4} {'tokens/s':>9} {'vs zero3':>8} {'fwd1 s':>7} {'s/token':>8} "
            f"{'inter fwd1':>11} {'inter/tok':>10} {'intra/tok':>10}")
    if linked:
        head += f" {'link fwd1':>10} {'link/tok':>9}"
    head += f" {'vs unsh':>8} {'cache MB':>8} {'tokens':>7}"
    lines = [f"greedy generation of {args.tokens} tokens, {args.arch} {args.layers}x{args.d_model} "
             f"({params / 1e6:.2f} M params), {topo.world_size} ranks = {topo.num_nodes} nodes x "
             f"{topo.ranks_per_node}; bytes summed over ranks; /tok: mean per token after the first", head]
    for r in runs:
        line = (f"{r['mode']:>10} {r['config']['weight_bits'] or 32:>4} {r['tokens_per_s']:>9.2f} "
                f"{_num(r['speedup_vs_zero3'], '.2f'):>8} {r['seconds_first_forward']:>7.3f} "
                f"{r['seconds_per_token_after_first']:>8.4f} {r['inter_bytes_first_forward']:>11} "
                f"{_num(r['inter_bytes_per_token_after_first']):>10} {_num(r['intra_bytes_per_token_after_first']):>10}")
        if linked:
            line += f" {_num(r['link_bytes_first_forward']):>10} {_num(r['link_bytes_per_token_after_first']):>9}"
        match = {True: "same", False: "DIFFER", None: "-"}[r["tokens_match"]]
        line += f" {_num(r['vs_unsharded'], '.2f'):>8} {r['cached_bytes_per_rank'] / 1e6:>8.2f} {match:>7}"
        lines.append(line)
    lines.append(f"unsharded model, no communication: {_num(unsharded_tps, '.2f')} tokens/s on rank 0 alone, "
                 f"{together_tps:.2f} on every rank at once ('vs unsh': the sharded mode against the latter); "
                 "cache MB: generation_mode's kept gathered weights per rank; "
                 "tokens compared with the unsharded fp32 model (zero3) or the exported quantized model (zeropp)")
    return "\n".join(lines)
