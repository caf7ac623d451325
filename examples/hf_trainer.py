"""Hugging Face ``Trainer`` on an FSDP2 (or HSDP) model with qcoll's comms: one callback.

    torchrun --nproc-per-node 4 examples/hf_trainer.py MODEL_DIR [--hsdp] [--accelerate-fsdp]

The model is sharded by Transformers itself at load time
(``from_pretrained(..., distributed_config=DistributedConfig(...))``: FSDP2, or HSDP with
``dp_replicate_size`` = nodes), which ``Trainer`` trains as it is, and
:class:`qcoll.integrations.hf.QuantizeCommCallback` quantizes its comms when training
begins. ``--accelerate-fsdp`` first asks Accelerate's FSDP2 plugin to shard
(``fsdp_config={"fsdp_version": 2}``), which it does on GPUs only: on CPU it leaves FSDP off
(distributed type ``MULTI_CPU``), and the callback refuses the unsharded model (printed).
Rank 0 prints the training loss and the collectives qcoll ran.
"""
import argparse
import os

import torch
from transformers import LlamaForCausalLM, Trainer, TrainingArguments
from transformers.distributed import DistributedConfig

import qcoll
from qcoll.integrations.hf import QuantizeCommCallback


class Windows(torch.utils.data.Dataset):
    """Random byte windows: a causal LM's inputs and labels."""

    def __init__(self, n=32, length=33):
        self.x = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--hsdp", action="store_true", help="replicate across nodes, shard inside")
    p.add_argument("--accelerate-fsdp", action="store_true",
                   help="first try Accelerate's FSDP2 plugin (GPUs only: on CPU it prints the callback's refusal)")
    p.add_argument("--out", default="trainer_out")
    args = p.parse_args()
    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.accelerate_fsdp:   # first Accelerate's plugin, which refuses on CPU, then the working path
        try:
            train(LlamaForCausalLM.from_pretrained(args.model_dir), args.out, fsdp=True,
                  fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
        except ValueError as e:
            print(f"accelerate fsdp: {type(e).__name__}: {e}", flush=True)
    config = (DistributedConfig(fsdp_size=per_node, dp_replicate_size=world // per_node) if args.hsdp
              else DistributedConfig(fsdp_size=world))
    train(LlamaForCausalLM.from_pretrained(args.model_dir, distributed_config=config), args.out)


def train(model, out, **fsdp):
    """Three Trainer steps with the callback; rank 0 prints what ran."""
    callback = QuantizeCommCallback()        # the nodes from LOCAL_WORLD_SIZE (or the HSDP mesh)
    qcoll.comm.stats.reset()
    training = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                                 report_to=[], save_strategy="no", logging_steps=1, learning_rate=1e-3, **fsdp)
    trainer = Trainer(model=model, args=training, train_dataset=Windows(), callbacks=[callback])
    result = trainer.train()
    if int(os.environ["RANK"]) == 0:
        calls = qcoll.comm.stats.snapshot()["calls"]
        print(f"modules {len(callback.modules)} loss {result.training_loss:.4f} calls {sorted(calls.items())}",
              flush=True)


if __name__ == "__main__":
    main()
