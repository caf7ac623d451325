"""Quantizer error on real gradients and weights (issue 19): plain 4-bit qgZ against per-hop
8/4, Hadamard rotation and outlier reserve; 2-bit weights plain against outlier reserve.

Run: python bench/quantizer_error.py --json bench/quantizer_error.json

4 ranks = 2 nodes x 2 (gloo, one host). Per model (``char``: the convergence test's character
transformer; ``llama``: a decoder from ``transformers.LlamaConfig``, as bench/convergence_sweep.py
builds them), every rank holds the same replica, trained data-parallel for ``--warm`` steps
(AdamW, lr 1e-3, unquantized gradient all-reduce) so that the gradients are those of a model in
training, not of its initialization. Then at ``--samples`` further steps each rank's own
micro-batch gradient (all parameters flattened, padded to the world) is reduce-scattered by each
variant, and compared with the unquantized reduce-scatter (``bits=None``) of the same gradients:
``rel_l2`` = ||out - ref|| / ||ref|| over all ranks' outputs, ``rel_max`` = max|out - ref| /
max|ref| (``qcoll-bench collectives``' ``max_err``). Weights: every rank's shard of the trained
weights (per parameter, padded to whole blocks, as the block-aligned layout does) all-gathered at
2 and 4 bits, plain and with outlier reserve, against the exact weights. Bytes: the inter-node
bytes per rank of one call, as ``qcoll.comm.stats`` counts them.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import qcoll
from qcoll.bench.cli import write_json
from qcoll.bench.ranks import run_ranks
from qcoll.comm import stats
from qcoll.testing import Batches, CharTransformer, TransformerConfig, byte_llama, causal_lm_loss, stdlib_bytes

CHAR = TransformerConfig(context=64, d_model=128, n_layers=4, n_heads=4)
GRAD_VARIANTS = {   # name -> reduce_scatter_quantized keyword arguments
    "4-bit": dict(bits=4),
    "8/4 per hop": dict(bits=(8, 4)),
    "4-bit hadamard": dict(bits=4, hadamard=True),
    "4-bit outliers=1": dict(bits=4, outliers=1),
    "4-bit outliers=2": dict(bits=4, outliers=2),
    "8/4 hadamard": dict(bits=(8, 4), hadamard=True),
    "2-bit": dict(bits=2),
    "2-bit hadamard": dict(bits=2, hadamard=True),
    "2-bit outliers=2": dict(bits=2, outliers=2),
    "8-bit": dict(bits=8),
}
WEIGHT_VARIANTS = {"2-bit": dict(bits=2), "2-bit outliers=1": dict(bits=2, outliers=1),
                   "2-bit outliers=2": dict(bits=2, outliers=2), "4-bit": dict(bits=4),
                   "4-bit outliers=1": dict(bits=4, outliers=1), "8-bit": dict(bits=8)}


def _build(name: str, seed: int):
    if name == "char":
        torch.manual_seed(seed)
        model = CharTransformer(CHAR)
        return model, lambda m, x, y: m(x, y)
    return byte_llama(CHAR.context, seed), causal_lm_loss


def _local_grad(model, loss_fn, x, y) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss_fn(model, x, y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    d = (got.double() - ref.double())
    sums = torch.tensor([float((d * d).sum()), float((ref.double() ** 2).sum())], dtype=torch.float64)
    hi = torch.tensor([float(d.abs().max()), float(ref.abs().max())], dtype=torch.float64)
    dist.all_reduce(sums)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return float(sums[0] / sums[1]) ** 0.5, float(hi[0] / hi[1])


def _grad_errors(a, topo, grads: list[torch.Tensor]) -> dict:
    W = topo.world_size
    out = {}
    for name, kw in GRAD_VARIANTS.items():
        l2 = mx = 0.0
        inter = 0
        for g in grads:
            S = -(-g.numel() // W)
            full = torch.zeros(W * S)
            full[: g.numel()] = g
            ref, got = torch.empty(S), torch.empty(S)
            qcoll.reduce_scatter_quantized(ref, full, bits=None, topology=topo)
            stats.reset()
            qcoll.reduce_scatter_quantized(got, full, block_size=a.grad_block, topology=topo, **kw)
            inter = stats.stats.inter_bytes
            e2, em = _errors(got, ref)
            l2, mx = l2 + e2 / len(grads), mx + em / len(grads)
        out[name] = {"rel_l2": l2, "rel_max": mx, "inter_bytes": inter}
    return out


def _weight_errors(a, topo, model) -> dict:
    W, r = topo.world_size, topo.rank
    out = {}
    for name, kw in WEIGHT_VARIANTS.items():
        sq = ref_sq = hi = ref_hi = 0.0
        inter = 0
        for p in model.parameters():
            if p.numel() < a.weight_block:
                continue
            flat = p.detach().reshape(-1)
            S = -(-(-(-flat.numel() // W)) // a.weight_block) * a.weight_block   # whole blocks per shard
            full = torch.zeros(W * S)
            full[: flat.numel()] = flat
            got = torch.empty(W * S)
            stats.reset()
            qcoll.all_gather_quantized(got, full[r * S:(r + 1) * S].clone(), block_size=a.weight_block, **kw)
            inter += stats.stats.inter_bytes
            d = (got - full)[: flat.numel()].double()
            sq += float((d * d).sum())
            ref_sq += float((flat.double() ** 2).sum())
            hi, ref_hi = max(hi, float(d.abs().max())), max(ref_hi, float(flat.abs().max()))
        out[name] = {"rel_l2": (sq / ref_sq) ** 0.5, "rel_max": hi / ref_hi, "inter_bytes": inter}
    return out


def _model_run(a, topo, name: str) -> dict:
    model, loss_fn = _build(name, a.seed)
    data = stdlib_bytes(1 << 20)
    batches = Batches(data, a.batch, CHAR.context, a.batch_seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(a.warm):   # data-parallel training: the unquantized all-reduce of the gradients
        x, y = batches.next(rank, world)
        model.zero_grad(set_to_none=True)
        loss_fn(model, x, y).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
    grads = []
    for _ in range(a.samples):
        x, y = batches.next(rank, world)
        grads.append(_local_grad(model, loss_fn, x, y))
    return {"model": name, "params": sum(p.numel() for p in model.parameters()),
            "grads": _grad_errors(a, topo, grads), "weights": _weight_errors(a, topo, model)}


def report(out: dict) -> str:
    lines = []
    for run in out["runs"]:
        lines.append(f"\n{run['model']} ({run['params']:,} parameters), gradients (qgZ, block {out['args']['grad_block']})")
        base = run["grads"]["4-bit"]
        lines.append(f"{'variant':<20} {'rel_l2':>8} {'vs 4-bit':>8} {'rel_max':>8} {'inter B':>10}")
        for k, v in run["grads"].items():
            lines.append(f"{k:<20} {v['rel_l2']:>8.4f} {v['rel_l2'] / base['rel_l2']:>8.3f} {v['rel_max']:>8.4f} "
                         f"{v['inter_bytes']:>10}")
        lines.append(f"weights (qwZ, block {out['args']['weight_block']})")
        for k, v in run["weights"].items():
            lines.append(f"{k:<20} {v['rel_l2']:>8.4f} {'':>8} {v['rel_max']:>8.4f} {v['inter_bytes']:>10}")
    return "\n".join(lines)


def _rank_main(a):
    topo = qcoll.Topology(a.ranks_per_node)
    t0 = time.perf_counter()
    out = {"command": "bench/quantizer_error.py", "args": vars(a), "runs": [_model_run(a, topo, m) for m in a.models]}
    out["wall_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        print(report(out), flush=True)
        if a.json:
            write_json(a.json, out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["char", "llama"], choices=["char", "llama"])
    p.add_argument("--warm", type=int, default=100, help="data-parallel training steps before measuring")
    p.add_argument("--samples", type=int, default=4, help="gradients measured (one per step after the warm-up)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--batch-seed", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grad-block", type=int, default=128)
    p.add_argument("--weight-block", type=int, default=256)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    run_ranks(_rank_main, a, a.nproc, a.ranks_per_node)


if __name__ == "__main__":
    main()
