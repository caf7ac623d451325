"""Peak gathered parameter bytes per rank on a GPT-2 built from config: default units vs
the whole body as one unit (the direct children, qcoll's default before block-level units).

Run: python bench/gathered_peak.py [--nproc 4] [--ranks-per-node 2] [--layers 12] [--d-model 256]
     [--vocab 50257 1024]
Needs transformers (the test extra). One forward+backward of a batch of 2 x 64 tokens per
rank, plain ZeRO-3 config (fp32 gathers), prefetch 1; prints, per vocabulary size, the
parameter count, each layout's units (the whole body; the default blocks; the blocks plus the
tied embedding and head as units of their own) and peak gathered bytes (``memory_report``'s
``gathered_peak``: full parameters held at once, sampled after every gather) and their ratio.
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

import qcoll
from qcoll import zero
from qcoll.bench.ranks import run_ranks


def _gpt2(args, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=max(1, args.d_model // 64),
                     vocab_size=vocab, n_positions=128)
    return GPT2LMHeadModel(cfg)


def _peak(model, topo, units) -> tuple[int, int]:
    m = zero.shard(model, topo, zero.ZeroConfig.zero3(), units=units)
    idx = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    m(idx, labels=idx).loss.backward()
    return zero.memory_report(m)["gathered_peak"], len(zero.state_of(m).units)


def _main(args) -> None:
    torch.set_num_threads(1)
    topo = qcoll.Topology(args.ranks_per_node)
    for vocab in args.vocab:
        base = _gpt2(args, vocab)
        params = sum(p.numel() for p in base.parameters())
        before = copy.deepcopy(base)
        whole, n_whole = _peak(before, topo, [before.transformer, before.lm_head])
        blocks, n_blocks = _peak(copy.deepcopy(base), topo, None)
        split = copy.deepcopy(base)
        block_class = type(split.transformer.h[0])
        emb, n_emb = _peak(split, topo, [split.transformer.wte, split.lm_head, block_class])
        if dist.get_rank() == 0:
            print(f"vocab {vocab}: {params / 1e6:.2f} M parameters ({params * 4 / 2**20:.1f} MiB fp32); "
                  f"whole body ({n_whole} units) peak {whole / 2**20:.1f} MiB; default block units ({n_blocks} units) "
                  f"peak {blocks / 2**20:.1f} MiB, ratio {blocks / whole:.3f}; blocks + embedding and head units "
                  f"({n_emb} units) peak {emb / 2**20:.1f} MiB, ratio {emb / whole:.3f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, nargs="+", default=[50257, 1024])
    args = p.parse_args(argv)
    run_ranks(_main, args, args.nproc, args.ranks_per_node)


if __name__ == "__main__":
    main()
