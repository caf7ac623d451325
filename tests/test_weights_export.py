"""export_quantized and load_quantized: the weight-quantized model as a file.

Oracle: the sharded model's own quantized forward (its logits), and an independent count of
the file's bytes. The loaded model is a plain module in this process (no torch.distributed
involved in loading it).
"""
import json
import os

import pytest
import torch

import qcoll
from qcoll import weights, zero
from qcoll.testing import Batches, TransformerConfig, corpus, tiny_model, train_steps


def _train_export(rank, world, path, bits, steps=2):
    """Train a few steps with quantized weights, then: the quantized forward's logits, export."""
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig(weight_bits=bits, hpz=True, grad_bits=4),
                   units=model.units())
    opt = zero.Optimizer(m, torch.optim.AdamW, lr=3e-3)
    train_steps(m, opt, Batches(corpus(), 8, 32, 3), steps, rank=rank, world=world)
    x, _ = Batches(corpus(), 4, 32, 99).next(0, 1)
    with torch.no_grad():
        logits = m(x)
    zero.export_quantized(m, path)
    return logits, x, m.state_dict()


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_loaded_model_equals_the_quantized_forward_bit_for_bit(ranks4, tmp_path, bits):
    path = str(tmp_path / "model.safetensors")
    out = ranks4.run(_train_export, path, bits, timeout=120)
    logits, x, trained = out[0]
    assert all(torch.equal(o[0], logits) for o in out)
    plain = weights.load_quantized(path, tiny_model(7))  # other initial values, overwritten
    with torch.no_grad():
        got = plain(x)
    assert torch.equal(got, logits)
    # and the values are quantized, not the trained fp32 weights: close to them, not equal
    loaded = plain.state_dict()
    w = "blocks.0.attn.qkv.weight" if "blocks.0.attn.qkv.weight" in loaded else next(
        k for k, v in loaded.items() if v.dim() == 2)
    assert not torch.equal(loaded[w], trained[w])
    assert (loaded[w] - trained[w]).abs().max() <= trained[w].abs().max() / (2 ** (bits - 1) - 1)


def test_file_size_and_metadata(ranks4, tmp_path):
    path = str(tmp_path / "model.safetensors")
    ranks4.run(_train_export, path, 4, 0, timeout=120)
    qw, plain, aliases, meta = weights.read(path)
    assert meta["bits"] == "4" and meta["block_size"] == "256" and meta["format"] == "qcoll.quantized"
    params = dict(tiny_model(0).named_parameters(remove_duplicate=False))
    shared = {k for k in params if any(params[k] is v and k != j for j, v in params.items())}
    assert set(qw) | set(aliases) == set(params)
    assert set(aliases) <= shared
    blocks = sum(-(-params[k].numel() // 256) for k in qw)
    assert sum(w.codes.numel() + 4 * w.scales.numel() for w in qw.values()) == blocks * (128 + 4)
    P = sum(p.numel() for k, p in params.items() if k in qw)
    formula = P * 4 / 8 + 4 * P / 256
    size = os.path.getsize(path)
    # padding of each parameter to whole blocks, the header and the buffers come on top
    assert formula <= size <= 1.1 * formula + 16384, (size, formula)
    info = json.loads(meta["tensors"])
    assert all(info[k]["shape"] == list(params[k].shape) for k in qw)


def _export_zero3(rank, world, path):
    model = tiny_model(0)
    m = zero.shard(model, qcoll.Topology(2), zero.ZeroConfig.zero3(), units=model.units())
    try:
        zero.export_quantized(m, path)
    except ValueError as e:
        return str(e)
    return None


def test_errors(ranks4, tmp_path):
    msg = ranks4.run(_export_zero3, str(tmp_path / "x.safetensors"), timeout=60)[0]
    assert msg and "weight_bits=None" in msg
    path = str(tmp_path / "model.safetensors")
    ranks4.run(_train_export, path, 8, 0, timeout=120)
    other = tiny_model(0, TransformerConfig(context=32, d_model=32, n_layers=2, n_heads=2))
    with pytest.raises(ValueError, match="the file holds shape"):
        weights.load_quantized(path, other)
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="not a qcoll quantized-weights file"):
        weights.load_quantized(str(tmp_path / "plain.safetensors"), tiny_model(0))
    with pytest.raises(FileNotFoundError):
        weights.read(str(tmp_path / "missing.safetensors"))
