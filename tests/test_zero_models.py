"""qcoll.zero on models as users bring them: torch.compile, the module stays the user's
(a Hugging Face decoder's ``generate``), block-level default units, a forward that reads
another unit's parameter, and torch's LR schedulers on qcoll's optimizer.

Oracles: the eager sharded run (for compile), the unsharded model in one process
(generate, training with a parameter read across units, schedulers).
"""
import copy

import pytest
import torch
from torch import nn

import qcoll
from qcoll import zero
from qcoll.testing import BatchList, Batches, check_parity, corpus, tiny_model, train_steps

BATCH = 8


# ---------------------------------------------------------------------------- torch.compile
def _compiled_losses(rank, world, mode):
    topo = qcoll.Topology(1)  # 2 nodes of 1 rank: qwZ and qgZ cross "nodes"
    model = tiny_model(0)
    if mode == "blocks":  # FSDP2's recommended pattern: compile each block, then shard
        for block in model.blocks:
            block.compile()
    m = zero.shard(model, topo, zero.ZeroConfig(), units=model.units())
    run = torch.compile(m) if mode == "whole" else m
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    return train_steps(run, opt, Batches(corpus(), BATCH, model.cfg.context, 7), 3, rank=rank, world=world)


def test_torch_compile_whole_model_and_blocks_match_eager(ranks2):
    """torch.compile (default backend, inductor) of the sharded model, and blocks compiled
    before sharding, train like the eager sharded model (ZeRO++ 8/4 with hpZ)."""
    eager = ranks2.run(_compiled_losses, "eager", timeout=120)[0]
    for mode in ("whole", "blocks"):
        got = ranks2.run(_compiled_losses, mode, timeout=300)[0]
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5, msg=mode)


# ---------------------------------------------------------------------------- a Hugging Face decoder
def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=96, n_positions=48, bos_token_id=0, eos_token_id=1,
                     pad_token_id=1)
    return GPT2LMHeadModel(cfg).eval()


def _hf_sharded(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    plain = _tiny_gpt2()
    model = copy.deepcopy(plain)
    sharded = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3())
    prompt = torch.tensor([[5, 17, 3, 42, 8]])
    with torch.no_grad():
        want = plain.generate(prompt, max_new_tokens=12, do_sample=False)
        got = sharded.generate(prompt, max_new_tokens=12, do_sample=False)
    units = [u.path for u in zero.state_of(sharded).units]
    import json
    import tempfile
    full_for_saving = sharded.state_dict()  # a collective, on every rank; the files from one rank (as Accelerate)
    architectures = ["GPT2LMHeadModel"]
    if rank == 0:
        with tempfile.TemporaryDirectory() as d:
            sharded.save_pretrained(d, state_dict=full_for_saving)
            with open(f"{d}/config.json") as f:
                architectures = json.load(f)["architectures"]
    assert architectures == ["GPT2LMHeadModel"] and type(sharded).__name__ == "GPT2LMHeadModel"
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(sharded)
    full, ref = sharded.state_dict(), plain.state_dict()
    same_state = set(full) == set(ref) and all(torch.equal(full[k], ref[k]) for k in ref)
    return (sharded is model, isinstance(sharded, GPT2LMHeadModel), isinstance(sharded.config, GPT2Config),
            got.tolist(), want.tolist(), units, same_state)


def test_hf_decoder_stays_the_users_model_and_generates_the_same_tokens(ranks4):
    pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e '.[test]')")
    for in_place, is_gpt2, has_config, got, want, units, same_state in ranks4.run(_hf_sharded, timeout=180):
        assert in_place and is_gpt2 and has_config
        assert got == want  # greedy tokens, plain ZeRO-3 config
        # default units: the model's _no_split_modules (GPT2Block); the root takes the rest
        assert units == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
        assert same_state  # state_dict() is the full, unsharded state


# ---------------------------------------------------------------------------- a parameter read across units
class TiedInParent(nn.Module):
    """The head is computed in the parent from the embedding unit's weight."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2))

    def forward(self, idx):
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h)
        return h @ self.emb.weight.T


def _cross_unit_training(rank, world):
    torch.manual_seed(0)
    plain = TiedInParent()
    model = copy.deepcopy(plain)
    model = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=[model.emb, *model.blocks])
    with pytest.raises(IndexError):  # a first forward that raises leaves the probe for the next one
        model(torch.full((2, 5), 99))
    gen = torch.Generator().manual_seed(3)
    # 2 rows per rank; the first forward finds the parameter, later ones gather it up front
    batches = BatchList((torch.randint(0, 32, (world * 2, 5), generator=gen),
                         torch.randint(0, 32, (world * 2, 5), generator=gen)) for _ in range(3))
    check_parity(model, zero.Optimizer(model, torch.optim.SGD, lr=0.5), plain,
                 torch.optim.SGD(plain.parameters(), lr=0.5), batches, 3, rank=rank, world=world,
                 loss_fn=lambda m, idx, target: nn.functional.cross_entropy(m(idx).reshape(-1, 32), target.reshape(-1)),
                 loss_atol=1e-5, rtol=0, atol=1e-5)


def test_a_forward_reading_another_units_parameter_trains_like_the_plain_model(ranks4):
    ranks4.run(_cross_unit_training, timeout=90)


# ---------------------------------------------------------------------------- torch's LR schedulers
def _scheduled(rank, world):
    model = tiny_model(0)
    plain = copy.deepcopy(model)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=model.units())
    opt = zero.Optimizer(m, torch.optim.SGD, lr=0.5, momentum=0.9)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 0.5 ** s)
    # with clipping and a schedule, the same model as plain torch
    check_parity(m, opt, plain, ref_opt, Batches(corpus(), BATCH, 32, 4), 3, rank=rank, world=world, rtol=0,
                 atol=1e-5, max_grad_norm=1.0, scheduler=sched, reference_scheduler=ref_sched)
    saved = opt.state_dict()
    lrs = [pg["lr"] for pg in opt.optimizer.param_groups]
    opt2 = zero.Optimizer(m, torch.optim.SGD, lr=0.5, momentum=0.9)
    opt2.load_state_dict(saved)
    restored = all(torch.equal(opt2.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])
                   for p in opt.masters) and [pg["lr"] for pg in opt2.param_groups] == lrs
    return isinstance(opt, torch.optim.Optimizer), lrs, calls, restored


def test_lr_scheduler_and_hooks_work_on_the_optimizer(ranks4):
    for is_torch_optimizer, lrs, calls, restored in ranks4.run(_scheduled, timeout=90):
        assert is_torch_optimizer
        assert lrs == [0.5 * 0.5 ** 3] * len(lrs)  # the scheduler's rate is the one that steps
        assert calls == ["pre", "post"] * 3
        assert restored


# ---------------------------------------------------------------------------- BERT, gradient checkpointing
def _bert_checkpointed(rank, world):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                     vocab_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    plain = BertForMaskedLM(cfg)
    plain.gradient_checkpointing_enable()
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3())
    gen = torch.Generator().manual_seed(5)
    ids = BatchList((torch.randint(0, 64, (world, 12), generator=gen),) for _ in range(2))  # one row per rank
    check_parity(model, zero.Optimizer(model, torch.optim.SGD, lr=0.5), plain,
                 torch.optim.SGD(plain.parameters(), lr=0.5), ids, 2, rank=rank, world=world, rtol=0, atol=1e-5,
                 loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss)
    return [u.path for u in zero.state_of(model).units]


def test_bert_with_gradient_checkpointing_trains_like_the_plain_model(ranks4):
    pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e '.[test]')")
    for units in ranks4.run(_bert_checkpointed, timeout=180):
        assert units == ["", "bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]


# ---------------------------------------------------------------------------- a forward that raises
def _raising_forward(rank, world):
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(), units=model.units())
    state = zero.state_of(m)
    bad = torch.zeros(2, model.cfg.context + 5, dtype=torch.long)  # longer than the positions: raises in the root
    for _ in range(2):  # the first forward (with its probe) and a later one
        with pytest.raises(RuntimeError):
            m(bad, bad)
    held = sum(g.gathered_nbytes() for g in state.groups)
    modes = torch._C._len_torch_function_stack()
    x, y = Batches(corpus(), BATCH, model.cfg.context, 2).next(rank, world)
    loss = m(x, y)
    loss.backward()
    return held, modes, bool(torch.isfinite(loss)), sum(g.gathered_nbytes() for g in state.groups)


def test_a_forward_that_raises_leaves_nothing_gathered_and_no_probe(ranks4):
    for held, modes, finite, held_after in ranks4.run(_raising_forward, timeout=60):
        assert held == 0 and modes == 0 and finite and held_after == 0


# ---------------------------------------------------------------------------- bf16 compute
def _bf16_compute(rank, world):
    model = tiny_model(0)
    plain = copy.deepcopy(model).to(torch.bfloat16)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(compute_dtype=torch.bfloat16))
    x, y = Batches(corpus(), BATCH, model.cfg.context, 9).next(rank, world)
    logits = m(x)  # token ids stay integers
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    plain_net = copy.deepcopy(net).to(torch.bfloat16)
    zero.shard(net, qcoll.Topology(2), zero.ZeroConfig.zero3(compute_dtype=torch.bfloat16))
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # fp32: the root's pre-hook casts it
    out = net(h)
    return logits.dtype, torch.equal(logits, plain(x)), out.dtype, torch.equal(out, plain_net(h.bfloat16()))


def test_bf16_compute_gathers_and_runs_in_bf16(ranks4):
    for dtype, same, net_dtype, net_same in ranks4.run(_bf16_compute, timeout=60):
        assert dtype == torch.bfloat16 and same and net_dtype == torch.bfloat16 and net_same


# ---------------------------------------------------------------------------- reads that need no gather
class ReadsMetadata(nn.Module):
    """A parent that reads a block's dtype (as HF's ``model.dtype``), with a user pre-hook on a block."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = x.to(self.blocks[0].weight.dtype)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _no_needless_gathers(rank, world):
    torch.manual_seed(0)
    plain = ReadsMetadata()
    model = copy.deepcopy(plain)
    seen = []
    model.blocks[1].register_forward_pre_hook(lambda mod, args: seen.append(float(mod.weight.sum())))
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out = model(x)
    out.sum().backward()
    root_groups = [g.name for g in zero.state_of(model).units[0].groups]
    return root_groups, torch.equal(out, plain(x)), seen == [float(plain.blocks[1].weight.sum())]


def test_metadata_reads_and_user_pre_hooks_gather_nothing_extra(ranks4):
    """The root keeps no block's group (reading .dtype needs none; a user pre-hook on a block runs
    after the block's own gather), so ZeRO-3 still holds one block at a time."""
    for root_groups, same, hook_saw_weights in ranks4.run(_no_needless_gathers, timeout=60):
        assert root_groups == [] and same and hook_saw_weights


def _cold_compiled_llama(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=64, max_position_embeddings=32)
    plain = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(rank))
    losses = []
    for compiled in (False, True):
        model = zero.shard(copy.deepcopy(plain), qcoll.Topology(1), zero.ZeroConfig.zero3())
        run = torch.compile(model, backend="eager") if compiled else model  # the first forward is compiled
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
    return losses


def test_a_cold_torch_compile_of_an_hf_llama_runs_the_probe_eagerly(ranks2):
    pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e '.[test]')")
    for eager, compiled in ranks2.run(_cold_compiled_llama, timeout=180):
        assert compiled == pytest.approx(eager, rel=1e-6, abs=1e-6)
