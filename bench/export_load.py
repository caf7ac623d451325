"""The exported weight-quantized model: file size and load time against plain fp32 safetensors.

Run: python bench/export_load.py [--nproc 2] [--layers 12] [--d-model 256] [--vocab 50257] [--bits 8 4]
Needs transformers (the test extra). Shards a GPT-2 built from config with ZeRO++ (hpZ, the
given weight bits, block 256), exports it with ``qcoll.zero.export_quantized``, and on rank 0
compares: the file's size against ``P * bits / 8 + 4 * P / 256`` and against the fp32
safetensors of the same model (``save_file`` of its state dict); the time to load it into a
model built from config with ``qcoll.weights.load_quantized`` (dequantize on load) against
``load_file`` + ``load_state_dict`` of the fp32 file (median of 3 each); and that the loaded
logits equal the sharded quantized forward's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import qcoll
from qcoll import weights, zero
from qcoll.bench.ranks import run_ranks


def _gpt2(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=max(1, args.d_model // 64),
                     vocab_size=args.vocab, n_positions=128)
    return GPT2LMHeadModel(cfg).eval()


def _median_time(fn, n=3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _main(args) -> None:
    from safetensors.torch import load_file, save_file

    torch.set_num_threads(1)
    topo = qcoll.Topology(args.ranks_per_node)
    rank = dist.get_rank()
    tmp = tempfile.mkdtemp() if rank == 0 else None
    box = [tmp]
    dist.broadcast_object_list(box)
    tmp = box[0]
    plain_path = os.path.join(tmp, "fp32.safetensors")
    if rank == 0:
        ref = _gpt2(args)
        state = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
        save_file(state, plain_path)
        fp32_load = _median_time(lambda: _gpt2(args).load_state_dict(load_file(plain_path), strict=False))
        params = sum(p.numel() for p in ref.parameters())
        print(f"GPT-2 {args.layers} layers, d {args.d_model}, vocab {args.vocab}: P = {params / 1e6:.2f} M; "
              f"fp32 safetensors {os.path.getsize(plain_path) / 2**20:.2f} MiB, load {fp32_load:.3f} s", flush=True)
    for bits in args.bits:
        m = zero.shard(_gpt2(args), topo, zero.ZeroConfig(weight_bits=bits, weight_block=256, hpz=True))
        idx = torch.randint(0, args.vocab, (2, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = m(idx).logits
        path = os.path.join(tmp, f"w{bits}.safetensors")
        t = time.perf_counter()
        zero.export_quantized(m, path)
        export_s = time.perf_counter() - t
        if rank == 0:
            P = params
            formula = P * bits / 8 + 4 * P / 256
            size = os.path.getsize(path)
            load_s = _median_time(lambda: weights.load_quantized(path, _gpt2(args)))
            loaded = weights.load_quantized(path, _gpt2(args))
            with torch.no_grad():
                same = torch.equal(loaded(idx).logits, want)
            print(f"{bits}-bit: file {size / 2**20:.2f} MiB = {size / formula:.3f} x formula, "
                  f"{size / os.path.getsize(plain_path):.3f} x fp32 file; export {export_s:.2f} s; "
                  f"load {load_s:.3f} s = {load_s / fp32_load:.2f} x fp32 load; logits equal: {same}", flush=True)
        dist.barrier()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4])
    args = p.parse_args(argv)
    run_ranks(_main, args, args.nproc, args.ranks_per_node)


if __name__ == "__main__":
    main()
