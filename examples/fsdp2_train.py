"""A plain FSDP2 training script with qcoll's quantized comms: one added call.

    torchrun --nnodes 2 --nproc-per-node 2 ... examples/fsdp2_train.py [--steps 5] [--no-qcoll]

Each block is sharded with ``reshard_after_forward=LOCAL_WORLD_SIZE`` (hpZ: after forward
the shard stays in the node) and the root after them; ``quantize_comm`` then puts 8-bit
weights and 4-bit gradients on the links between nodes. Rank 0 prints, per step, the
loss and the bytes qcoll's collectives handed to groups that span nodes.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import qcoll
import qcoll.fsdp
from qcoll.testing import Batches, char_transformer, corpus
from qcoll.testing.models import TransformerConfig


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-qcoll", action="store_true", help="plain FSDP2 (for comparison)")
    args = parser.parse_args()
    dist.init_process_group("gloo")          # "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(1)

    model = char_transformer(TransformerConfig(context=32, d_model=64, n_layers=2, n_heads=2), seed=0)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=ranks_per_node)
    fully_shard(model, mesh=mesh)
    if not args.no_qcoll:
        qcoll.fsdp.quantize_comm(model)      # the nodes from LOCAL_WORLD_SIZE; weight_bits=8, grad_bits=4, hpZ

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = Batches(corpus(), batch=8, context=32)
    for step in range(args.steps):
        qcoll.comm.stats.reset()
        x, y = batches.next(rank, world)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)               # (gloo has no AVG)
        if rank == 0:
            print(f"step {step} loss {total.item() / world:.4f} inter_bytes {qcoll.comm.stats.snapshot()['inter_bytes']}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
