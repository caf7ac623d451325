"""qcoll.quant.rows: the one place that picks where the codec runs."""
import types

import pytest
import torch

from qcoll.quant import cpu, reference, rows


def _cuda_like():
    """Enough of a CUDA tensor for the choice (rows reads ``is_cuda`` and ``device`` only)."""
    return types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))


def test_cpu_tensors_run_the_cpu_path(monkeypatch):
    assert rows.codec_for(torch.zeros(1)) is cpu
    monkeypatch.setenv("QCOLL_BACKEND", "reference")  # CPU tensors keep the (byte-identical) fast path
    assert rows.codec_for(torch.zeros(1)) is cpu


def test_other_devices_run_the_reference():
    assert rows.codec_for(torch.zeros(1, device="meta")) is reference


def test_cuda_tensors_run_the_kernels_unless_told_otherwise(monkeypatch):
    kernels = types.SimpleNamespace(name="bindings")
    monkeypatch.setattr(rows, "_cuda_kernels", lambda: kernels)
    assert rows.codec_for(_cuda_like()) is kernels
    monkeypatch.setenv("QCOLL_BACKEND", "reference")
    assert rows.codec_for(_cuda_like()) is reference
    monkeypatch.setenv("QCOLL_BACKEND", " Auto ")
    assert rows.codec_for(_cuda_like()) is kernels
    monkeypatch.setattr(rows, "_cuda_kernels", lambda: None)  # no CuPy
    assert rows.codec_for(_cuda_like()) is reference


@pytest.mark.parametrize("value", ["cuda", "kernels"])
def test_unknown_backend_is_an_error(monkeypatch, value):
    monkeypatch.setenv("QCOLL_BACKEND", value)
    with pytest.raises(ValueError, match="QCOLL_BACKEND must be one of"):
        rows.quantize_rows(torch.zeros(1, 64), 8, 32)


def test_each_function_goes_one_call_down(monkeypatch):
    """Every row function hands its arguments, unchanged, to the chosen module's twin."""
    seen = []
    fake = types.SimpleNamespace(**{name: (lambda *a, _n=name: seen.append((_n, a)) or _n) for name in (
        "quantize_rows", "dequantize_rows", "dequantize_rows_into", "swizzle_quantize", "dequantize_reduce",
        "reduce_requantize")})
    monkeypatch.setattr(rows, "codec_for", lambda t: fake)
    t = object()
    calls = {"quantize_rows": (t, 8, 32, True, 5, 7), "dequantize_rows": (t, 10, 8, 32, torch.float16),
             "dequantize_rows_into": (t, 10, 8, 32, "out"), "swizzle_quantize": (t, 2, 3, 4, 64, True, 1, 2),
             "dequantize_reduce": (t, 10, 4, 64), "reduce_requantize": (t, 10, 4, 64, 8, 128, True, 9, 11)}
    for name, args in calls.items():
        assert getattr(rows, name)(*args) == name
    assert seen == list(calls.items())


def test_cpu_path_matches_the_reference_below_the_compile_threshold():
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    for bits in (8, 6, 4, 2):
        for stochastic in (False, True):
            want = reference.quantize_rows(x, bits, 64, stochastic, 7, 3)
            got = rows.quantize_rows(x, bits, 64, stochastic, 7, 3)
            assert torch.equal(got, want)
            assert torch.equal(rows.dequantize_rows(got, 1000, bits, 64, torch.bfloat16),
                               reference.dequantize_rows(want, 1000, bits, 64, torch.bfloat16))
    bufs = torch.stack([reference.quantize_rows(x * j, 4, 128) for j in range(1, 4)])
    assert torch.equal(rows.dequantize_reduce(bufs, 1000, 4, 128), reference.dequantize_reduce(bufs, 1000, 4, 128))
    assert torch.equal(rows.reduce_requantize(bufs, 1000, 4, 128, 8, 256, True, 1, 2),
                       reference.reduce_requantize(bufs, 1000, 4, 128, 8, 256, True, 1, 2))
    flat = x.reshape(-1)[:2 * 3 * 400]
    assert torch.equal(rows.swizzle_quantize(flat, 2, 3, 4, 64, True, 5, 6),
                       reference.swizzle_quantize(flat, 2, 3, 4, 64, True, 5, 6))
