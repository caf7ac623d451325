"""Module methods called outside the root forward: encoder-decoder ``generate`` (Hugging Face calls
``model.get_encoder()(...)`` on its own), ``model.encoder(...)`` called directly, and
``qcoll.zero.register_forward_method`` (FSDP2's ``register_fsdp_forward_method``).

Oracles: the unsharded T5's tokens and encoder outputs (ZeRO-3 config); the exported
weight-quantized model loaded into an unsharded copy (ZeRO++ config, with and without
generation mode).
"""
import copy

import pytest
import torch

import qcoll
from qcoll import weights, zero

pytest.importorskip("transformers", reason="transformers is a test extra (pip install -e '.[test]')")

PROMPT = torch.tensor([[5, 9, 3, 7, 2, 11]])
NEW = 6


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
                   initializer_factor=8.0)  # larger initial weights: tokens that differ from step to step
    return T5ForConditionalGeneration(cfg).eval()


def _generate(model):
    return model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, suppress_tokens=[0, 1],
                          no_repeat_ngram_size=1).tolist()


def _zero3(rank, world):
    plain = _tiny_t5()
    want = _generate(plain)
    with torch.no_grad():
        want_encoder = plain.encoder(input_ids=PROMPT).last_hidden_state
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3())
    got = _generate(model)
    with model.generation_mode():
        got_mode = _generate(model)
    with torch.no_grad():
        encoder = model.encoder(input_ids=PROMPT).last_hidden_state
        via_get = model.get_encoder()(input_ids=PROMPT).last_hidden_state
    released = all(p.numel() == 0 for p in model.parameters())
    return want, got, got_mode, torch.equal(encoder, want_encoder), torch.equal(via_get, want_encoder), released


def test_t5_generate_under_zero3_gives_the_unsharded_tokens(ranks4):
    for want, got, got_mode, encoder_equal, via_get_equal, released in ranks4.run(_zero3, timeout=120):
        assert len(set(want[0][1:])) > 1
        assert got == want and got_mode == want
        assert encoder_equal and via_get_equal
        assert released  # every call resharded what it gathered


def _zeropp(rank, world, path):
    plain = _tiny_t5()
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig())
    zero.export_quantized(model, path)
    exported = _generate(weights.load_quantized(path, copy.deepcopy(plain)))
    got = _generate(model)
    with model.generation_mode():
        got_mode = _generate(model)
    return exported, got, got_mode


def test_t5_generate_under_zeropp_gives_the_exported_models_tokens(ranks4, tmp_path):
    for exported, got, got_mode in ranks4.run(_zeropp, str(tmp_path / "t5.safetensors"), timeout=180):
        assert got == exported and got_mode == exported


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.head = torch.nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)

    def embed_and_score(self, ids):  # a method that is not forward, reading a root parameter directly
        return (self.emb(ids) @ self.head.weight.T).sum(-1)


def _method(rank, world, register):
    plain = TwoHeads()
    ids = torch.tensor([[1, 2, 3]])
    want = plain.embed_and_score(ids)
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3())
    if register:
        zero.register_forward_method(model, "embed_and_score")
    try:
        return torch.equal(model.embed_and_score(ids), want)
    except RuntimeError as e:
        return str(e)


def test_register_forward_method_gathers_what_the_method_reads(ranks4):
    assert ranks4.run(_method, True, timeout=60) == [True] * 4
    unregistered = ranks4.run(_method, False, timeout=60)[0]
    assert unregistered is not True  # without it the method reads released parameters


def test_register_forward_method_refuses_what_is_not_sharded():
    with pytest.raises(TypeError, match="module must be a model sharded"):
        zero.register_forward_method(TwoHeads(), "embed_and_score")


def _registered_generate(rank, world):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    plain = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,
                                       bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    prompt = torch.tensor([[5, 17, 3, 42]])
    run = lambda m: m.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False).tolist()  # noqa: E731
    want = run(plain)
    model = zero.shard(copy.deepcopy(plain), qcoll.Topology(2), zero.ZeroConfig.zero3())
    zero.register_forward_method(model, "generate")  # FSDP2's usual registration: its forwards nest inside
    return run(model) == want


def test_a_registered_method_that_calls_the_forward(ranks4):
    assert all(ranks4.run(_registered_generate, timeout=120))


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.head = torch.nn.Linear(8, 16)
        self.reentrant = reentrant

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:  # activation checkpointing of each unit: recomputed inside the backward
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h)).logsumexp(-1).mean()


def _checkpointed(rank, world, reentrant):
    from qcoll.testing import BatchList, check_parity

    model = Checkpointed(reentrant)
    reference = copy.deepcopy(model)
    zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=list(model.blocks))
    ids = [(torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(i)),) for i in range(3)]
    check_parity(model, zero.Optimizer(model, torch.optim.SGD, lr=0.5), reference,
                 torch.optim.SGD(reference.parameters(), lr=0.5), BatchList(ids), 3, rank=rank, world=world,
                 rtol=2e-5, atol=2e-5, loss_rtol=1e-5)
    return True


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointed_units_train_like_one_process(ranks4, reentrant):
    """The recompute inside the backward is not a call from outside the model's forward."""
    assert all(ranks4.run(_checkpointed, reentrant, timeout=120))
