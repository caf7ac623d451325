"""The codec against an independent float64/numpy oracle of docs/FORMAT.md (round to nearest)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import qcoll

QMAX = {8: 127, 6: 31, 4: 7, 2: 1}


def oracle_bytes(x32: np.ndarray, bits: int, block: int) -> bytes:
    qm = QMAX[bits]
    nb = -(-x32.size // block)
    xb = np.zeros(nb * block, np.float32)
    xb[: x32.size] = x32
    xb = xb.reshape(nb, block)
    codes, scales = [], []
    for b in xb:
        amax = np.float32(np.max(np.abs(b))) if b.size else np.float32(0)
        if not np.isfinite(amax):
            codes.append(np.zeros(block, np.int64))
            scales.append(np.array([0x7FC00000], np.uint32).view(np.float32)[0])
            continue
        scale = np.float32(amax / np.float32(qm))
        inv = np.float32(0) if amax == 0 else np.float32(np.float32(qm) / amax)
        q = np.clip(np.rint((b * inv).astype(np.float32)), -qm, qm).astype(np.int64)
        codes.append(q)
        scales.append(scale)
    c = np.concatenate(codes) & ((1 << bits) - 1) if codes else np.zeros(0, np.int64)
    if bits == 8:
        packed = c.astype(np.uint8)
    elif bits == 6:
        g = c.reshape(-1, 4)
        v = g[:, 0] | g[:, 1] << 6 | g[:, 2] << 12 | g[:, 3] << 18
        packed = np.stack([v & 255, v >> 8 & 255, v >> 16], 1).reshape(-1).astype(np.uint8)
    else:
        per = 8 // bits
        g = c.reshape(-1, per)
        packed = sum(g[:, j] << (bits * j) for j in range(per)).astype(np.uint8)
    return packed.tobytes() + np.asarray(scales, "<f4").tobytes()


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 6, 4, 2]), block=st.sampled_from([32, 64, 256]),
       n=st.integers(0, 700), seed=st.integers(0, 2**31), scale=st.sampled_from([1e-3, 1.0, 1e4]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_bytes_and_error_bound_match_oracle(bits, block, n, seed, scale, dtype):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    p = qcoll.quantize(x, bits=bits, block_size=block)
    x32 = x.float().numpy()
    assert p.data.numpy().tobytes() == oracle_bytes(x32, bits, block)
    y = qcoll.dequantize(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    half = np.repeat(p.scales.double().numpy() / 2, block)[:n]
    err = np.abs(qcoll.dequantize(p, dtype=torch.float32).double().numpy() - x32.astype(np.float64))
    # scale/2 in exact arithmetic, plus the fp32 rounding of q * scale itself
    assert np.all(err <= half + np.abs(x32.astype(np.float64)) * 2**-23)


def test_nonfinite_block_is_all_nan_and_canonical():
    x = torch.randn(3 * 64)
    x[70] = float("inf")
    p = qcoll.quantize(x, bits=4, block_size=64)
    y = qcoll.dequantize(p)
    assert torch.isnan(y[64:128]).all() and not torch.isnan(y[:64]).any() and not torch.isnan(y[128:]).any()
    assert p.data.numpy().tobytes() == oracle_bytes(x.numpy(), 4, 64)


@pytest.mark.parametrize("kwargs,word", [({"bits": 3}, "bits"), ({"block_size": 100}, "block_size"),
                                         ({"seed": -1}, "seed"), ({"bits": True}, "bits")])
def test_bad_arguments_name_the_argument(kwargs, word):
    with pytest.raises((ValueError, TypeError), match=word):
        qcoll.quantize(torch.randn(10), **kwargs)


@pytest.mark.parametrize("field,value,word", [("bits", 3, "packed.bits"), ("bits", True, "packed.bits"),
                                              ("block_size", 100, "packed.block_size"), ("numel", -1, "packed.numel"),
                                              ("numel", 10.0, "packed.numel"), ("data", b"\\0" * 44, "packed.data")])
def test_dequantize_checks_what_a_hand_made_packed_holds(field, value, word):
    """qcoll.dequantize is the entry point that checks a Packed (the layers below trust their arguments)."""
    import dataclasses

    bad = dataclasses.replace(qcoll.quantize(torch.randn(10), bits=8, block_size=32), **{field: value})
    with pytest.raises((ValueError, TypeError), match=word):
        qcoll.dequantize(bad)


def test_bad_input_and_out():
    with pytest.raises(TypeError, match="x"):
        qcoll.quantize(torch.arange(10))
    p = qcoll.quantize(torch.randn(10))
    with pytest.raises(ValueError, match="out"):
        qcoll.dequantize(p, out=torch.empty(11))
    with pytest.raises(TypeError, match="out"):
        qcoll.dequantize(p, out=torch.empty(10, dtype=torch.int32))


def test_stochastic_is_reproducible_and_unbiased():
    x = torch.full((256,), 0.3) * torch.linspace(0.1, 1, 256)
    a = qcoll.quantize(x, bits=4, block_size=256, stochastic=True, seed=5)
    b = qcoll.quantize(x, bits=4, block_size=256, stochastic=True, seed=5)
    assert torch.equal(a.data, b.data)
    draws = torch.stack([qcoll.dequantize(qcoll.quantize(x, 4, 256, True, s)) for s in range(400)])
    scale = float(a.scales[0])
    # each draw's error is within one step (scale) with variance <= scale^2/4, so the mean of
    # 400 draws per element is within 5 standard errors = 5 * scale / (2 * 20) almost surely
    assert float((draws.mean(0) - x).abs().max()) <= 5 * scale / 40


def test_bitpack_takes_views_and_names_bad_sizes():
    """Unaligned and strided inputs pack/unpack like their contiguous copies; sizes that no
    packed unit fits raise ValueError naming the tensor."""
    from qcoll.quant.bitpack import pack_codes, unpack_codes

    qmax = {6: 31, 4: 7, 2: 1}  # DESIGN.md: 2**(bits-1) - 1
    g = torch.Generator().manual_seed(3)
    for bits in (6, 4, 2):
        qm = qmax[bits]
        flat = torch.randint(-qm, qm + 1, (3 * 64 + 1,), dtype=torch.int8, generator=g)
        q = flat[1:].view(3, 64)  # storage offset 1
        packed = pack_codes(q, bits)
        assert torch.equal(packed, pack_codes(q.clone(), bits))
        assert torch.equal(unpack_codes(packed.t().contiguous().t(), bits), q)  # strided input
    with pytest.raises(ValueError, match=r"q must have a last dimension that is a multiple of 16"):
        pack_codes(torch.zeros(20, dtype=torch.int8), 6)
    with pytest.raises(ValueError, match=r"b must have a last dimension that is a multiple of 3"):
        unpack_codes(torch.zeros(4, dtype=torch.uint8), 6)
