"""The torch.compile'd CPU fast path is byte-identical to the eager reference."""
import pytest
import torch

from qcoll.quant import compiled, reference


@pytest.mark.parametrize("bits,rows", [(8, 1), (6, 1), (4, 1), (2, 1), (4, 2), (8, 2)])
def test_compiled_fast_path_matches_eager(monkeypatch, bits, rows):
    n = compiled.MIN_NUMEL // rows + 77
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(rows, n, generator=g) * torch.logspace(-3, 3, n).unsqueeze(0)
    x[0, 256:512] = 0
    x[0, 1024 + 5] = float("nan")
    x[0, 4096 + 9] = float("-inf")
    assert compiled.enabled(x.device, x.numel())
    fast = reference.quantize_rows(x, bits, 256)
    assert not compiled._broken
    fast_deq = reference.dequantize_rows(fast, n, bits, 256, torch.float32)
    monkeypatch.setenv("QCOLL_COMPILE", "0")
    assert not compiled.enabled(x.device, x.numel())
    eager = reference.quantize_rows(x, bits, 256)
    eager_deq = reference.dequantize_rows(eager, n, bits, 256, torch.float32)
    assert torch.equal(fast, eager)
    assert torch.equal(torch.isnan(fast_deq), torch.isnan(eager_deq))
    assert torch.equal(torch.nan_to_num(fast_deq), torch.nan_to_num(eager_deq))
