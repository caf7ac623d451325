"""qcoll's FSDP2 comms in the stacks users run, on CPU/gloo: a torchrun script on two
emulated nodes, PEFT LoRA on an FSDP2 model, the Hugging Face Trainer (Accelerate's FSDP2)."""
import ast
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import qcoll
from distributed import free_port
from qcoll.fsdp import quantize_comm

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "fsdp2_train.py"


def _two_nodes(script, *args, cwd, timeout=240):
    """``script`` on 2 emulated nodes x 2 ranks: one torchrun per node, static rendezvous on this
    host; returns [(returncode, stdout, stderr)] per node."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", QCOLL_PROGRESS="0")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                               "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(script), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                              start_new_session=True)
             for node in (0, 1)]
    done = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            done.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    return done


def _torchrun_two_nodes(*extra):
    """The example's (loss, cross-node bytes) per step on rank 0.

    Known issue (seen once in CI, 2026-12-07): every step done, a worker can hang at exit after
    ``destroy_process_group`` (gloo's teardown with qcoll's node groups alive). Such a run is tried
    once more, with a warning naming it; a second hang, or any other failure, fails the test."""
    try:
        done = _two_nodes(SCRIPT, "--steps", "4", *extra, cwd=ROOT / "examples", timeout=120)
    except subprocess.TimeoutExpired as e:
        import warnings
        warnings.warn(f"the torchrun example hung (known teardown issue), trying once more: {e}")
        done = _two_nodes(SCRIPT, "--steps", "4", *extra, cwd=ROOT / "examples")
    for rc, _, err in done:
        assert rc == 0, err[-3000:]
    steps = [tuple(map(float, m)) for m in re.findall(r"step \d+ loss ([\d.]+) inter_bytes (\d+)", done[0][1])]
    assert len(steps) == 4, done[0][1]
    return steps


def _single_process_losses(steps: int) -> list[float]:
    """The oracle: the script's model trained in one process on the whole global batches (AdamW, clipping)."""
    from qcoll.testing import Batches, char_transformer, corpus
    from qcoll.testing.models import TransformerConfig

    model = char_transformer(TransformerConfig(context=32, d_model=64, n_layers=2, n_heads=2), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches, losses = Batches(corpus(), batch=8, context=32), []
    for _ in range(steps):
        loss = model(*batches.next())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


@pytest.mark.slow
def test_plain_fsdp2_script_under_torchrun_on_two_nodes():
    """Losses within quantization error of one process training on the global batches; across nodes
    at most a quarter of what plain FSDP2 hands across (DESIGN.md's rule: per unit two all-gathers
    and a reduce-scatter of 3 fp32 shards each, on 4 ranks over 2 nodes)."""
    from qcoll.testing import char_transformer
    from qcoll.testing.models import TransformerConfig

    quantized = _torchrun_two_nodes()
    model = char_transformer(TransformerConfig(context=32, d_model=64, n_layers=2, n_heads=2), seed=0)
    fsdp2_bytes = 3 * 3 * 4 * sum(math.ceil(p.numel() / 4) for p in model.parameters())
    oracle = _single_process_losses(len(quantized))
    assert quantized[0][0] == pytest.approx(oracle[0], rel=2e-3)      # the first forward: 8-bit weights only
    for (loss, sent), want in zip(quantized, oracle):
        assert math.isfinite(loss) and abs(loss - want) <= 0.02 * want
        assert 0 < sent <= 0.25 * fsdp2_bytes
    assert [round(l, 6) for l, _ in quantized] != [round(w, 6) for w in oracle]     # it did quantize
    assert quantized[-1][0] < quantized[0][0]


def _lora(rank, world):
    from peft import LoraConfig, get_peft_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from qcoll.testing import byte_llama, causal_lm_loss
    from qcoll.testing.fsdp2 import mesh_for, shard_fsdp2

    topo = qcoll.Topology(2)
    model = get_peft_model(byte_llama(32, seed=0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                              lora_dropout=0.0, init_lora_weights="gaussian"))
    layers = model.base_model.model.model.layers
    shard_fsdp2(model, layers, mesh_for(False, 2), reshard_after_forward=2)
    quantize_comm(model, topo)
    full = StateDictOptions(full_state_dict=True)
    before = {k: v.clone() for k, v in get_model_state_dict(model, options=full).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 32), generator=gen)
        causal_lm_loss(model, x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    after = get_model_state_dict(model, options=full)
    return {k: torch.equal(before[k], after[k]) for k in before}


@pytest.mark.slow
def test_peft_lora_on_fsdp2_with_qcoll_changes_only_the_adapters(ranks4):
    same = ranks4.run(_lora, timeout=300)[0]
    lora = [k for k in same if "lora_" in k]
    frozen = [k for k in same if "lora_" not in k]
    assert lora and frozen
    assert all(same[k] for k in frozen), [k for k in frozen if not same[k]]
    assert not any(same[k] for k in lora), [k for k in lora if same[k]]


def _trainer(model_dir, *flags):
    """examples/hf_trainer.py on 2 nodes x 2 ranks: (returncode, rank 0's stdout, stderrs)."""
    done = _two_nodes(ROOT / "examples" / "hf_trainer.py", str(model_dir), "--out", str(model_dir / "out"), *flags,
                      cwd=model_dir)
    return max(rc for rc, _, _ in done), done[0][1], "".join(err for _, _, err in done)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from qcoll.testing import byte_llama

    d = tmp_path_factory.mktemp("llama")
    byte_llama(32).save_pretrained(d)
    return d


@pytest.mark.slow
@pytest.mark.long   # ~33 s: Trainer and accelerate under torchrun
def test_hf_trainer_refused_by_accelerate_on_cpu_then_on_a_transformers_sharded_hsdp_model(llama_dir):
    """One launch, two Trainers. (1) Accelerate's FSDP2 plugin shards on GPUs only: on CPU the Trainer
    runs MULTI_CPU (DDP), no FSDP module exists, and the callback raises instead of training
    unquantized. (2) Transformers' own HSDP sharding at load time (DistributedConfig(fsdp_size=2,
    dp_replicate_size=2)), the Trainer, QuantizeCommCallback: the quantized cross-node all-reduce ran
    (an all-to-all and an all-gather per parameter group and step). The 1-D mesh is the same callback
    on FSDP2's 1-D path, which the script above and tests/test_fsdp_*.py cover."""
    rc, out, err = _trainer(llama_dir, "--hsdp", "--accelerate-fsdp")
    assert rc == 0, err[-3000:]
    assert ("accelerate fsdp: ValueError: QuantizeCommCallback: LlamaForCausalLM reached training without FSDP2 "
            "modules (Accelerate's distributed type: MULTI_CPU, TrainingArguments.fsdp=True)") in out, out
    m = re.search(r"modules (\d+) loss ([\d.]+) calls (.*)", out)
    assert m, out
    calls = dict(ast.literal_eval(m.group(3)))
    assert int(m.group(1)) > 1 and math.isfinite(float(m.group(2)))
    assert calls["all_to_all"] == calls["all_gather"] > 0


def test_trainer_fsdp2_config_takes_no_ranks_per_node_so_the_callback_defaults_to_no_hpz(monkeypatch):
    """hpZ is reshard_after_forward=<ranks per node>; Transformers' fsdp_config and Accelerate's
    FSDP2 plugin take a bool only, with these errors (why QuantizeCommCallback has hpz=False)."""
    import inspect

    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    from qcoll.integrations.hf import QuantizeCommCallback

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")   # TrainingArguments sets it: undone after
    config = {"fsdp_version": 2, "reshard_after_forward": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    with pytest.raises(ValueError, match=r"^invalid truth value 2$"):
        TrainingArguments(output_dir="unused", use_cpu=True, report_to=[], fsdp=True, fsdp_config=config)
    with pytest.raises(ValueError, match=r"^reshard_after_forward set to 2\. This is not supported with FSDP2, "
                                         r"please set to a `bool`$"):
        FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=2)
    assert inspect.signature(QuantizeCommCallback).parameters["hpz"].default is False
