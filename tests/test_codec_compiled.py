"""The torch.compile'd CPU fast path (qcoll.quant.cpu) is byte-identical to the eager reference."""
import pytest
import torch

from qcoll.quant import compiled, cpu, reference


def _same(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("bits,rows,block,dtype", [
    (8, 1, 256, torch.float32), (6, 1, 256, torch.float32), (4, 1, 256, torch.float32),
    (2, 1, 256, torch.float32), (4, 2, 128, torch.bfloat16), (8, 2, 128, torch.float16),
    (6, 3, 64, torch.bfloat16),
])
def test_compiled_fast_path_matches_eager(monkeypatch, bits, rows, block, dtype):
    taken = []  # what the compiled path returned: a tensor / True when it ran, None / False when it declined
    for name in ("quantize_rows", "dequantize_rows_into"):
        real = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, _real=real: taken.append(_real(*a)) or taken[-1])
    n = compiled.MIN_NUMEL // rows + 77  # a partial last block
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n).unsqueeze(0)
    x[0, 256:512] = 0
    x[0, 1024 + 5] = float("nan")
    x[-1, 4096 + 9] = float("-inf")
    assert compiled.enabled(x.device, x.numel())
    fast = cpu.quantize_rows(x, bits, block)
    fast_deq = cpu.dequantize_rows(fast, n, bits, block, dtype)
    into = torch.full((rows, 2 * n), 7.0, dtype=dtype)[:, ::2]  # a strided out
    cpu.dequantize_rows_into(fast, n, bits, block, into)
    assert not compiled._broken
    assert len(taken) == 3 and all(t is True or isinstance(t, torch.Tensor) for t in taken), taken
    monkeypatch.setenv("QCOLL_COMPILE", "0")
    assert not compiled.enabled(x.device, x.numel())
    assert torch.equal(cpu.quantize_rows(x, bits, block), fast) and len(taken) == 3  # QCOLL_COMPILE=0: the reference
    monkeypatch.delenv("QCOLL_COMPILE")
    eager = reference.quantize_rows(x, bits, block)
    eager_deq = reference.dequantize_rows(eager, n, bits, block, dtype)
    assert torch.equal(fast, eager)
    assert fast_deq.dtype == dtype and _same(fast_deq, eager_deq) and _same(into, eager_deq)
    # eager's own conversion: the fp32 values rounded to the output dtype
    assert _same(eager_deq, reference.dequantize_rows(eager, n, bits, block, torch.float32).to(dtype))


@pytest.mark.parametrize("n", [100, compiled.MIN_NUMEL])
def test_dequantize_into_rejects_a_wrong_out_shape(n):
    buf = reference.quantize_rows(torch.randn(2, n), 8, 64)
    for codec in (reference, cpu):
        with pytest.raises(ValueError, match=rf"out must have shape \(2, {n}\)"):
            codec.dequantize_rows_into(buf, n, 8, 64, torch.empty(2, n - 1))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [1000, compiled.MIN_NUMEL + 3])
def test_dequantize_into_out_that_holds_the_packed_bytes(bits, n):
    """``out`` sharing memory with the packed buffer (decoding in place) gives the exact values."""
    import qcoll

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    packed = qcoll.quantize(x, bits=bits, block_size=64)
    want = qcoll.dequantize(packed)
    store = torch.zeros(n)
    nbytes = packed.nbytes
    store.view(torch.uint8)[:nbytes].copy_(packed.data)
    aliased = qcoll.Packed(store.view(torch.uint8)[:nbytes], n, bits, 64, x.shape, x.dtype)
    assert torch.equal(qcoll.dequantize(aliased, out=store), want)
