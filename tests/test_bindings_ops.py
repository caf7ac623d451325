"""The custom ops of qcoll.bindings on CPU tensors: registration, tracing, the eager shortcut.

On CPU the ops run the torch reference, so everything here runs without a GPU: the schemas
and fake implementations (``torch.library.opcheck``), torch.compile through the ops, and the
eager shortcut that calls the implementation without the dispatcher.
"""
from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qcoll.bindings import launch, ops
from qcoll.quant import reference


def _inputs(seed=0):
    """(name, public function, op, args) for each op, on small CPU tensors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 300, generator=g)
    q8 = reference.quantize_rows(x, 8, 64, False, 0, 0)
    parts = torch.stack([reference.quantize_rows(torch.randn(3, 300, generator=g), 4, 128, False, 0, 0)
                         for _ in range(4)])
    flat = torch.randn(2 * 3 * 40, generator=g)
    return [
        ("quantize_rows", ops.quantize_rows, "_quantize_rows_op", (x, 6, 64, True, 11, 5)),
        ("dequantize_rows", ops.dequantize_rows, "_dequantize_rows_op", (q8, 300, 8, 64, torch.bfloat16)),
        ("swizzle_quantize", ops.swizzle_quantize, "_swizzle_quantize_op", (flat, 2, 3, 4, 64, False, 0, 0)),
        ("dequantize_reduce", ops.dequantize_reduce, "_dequantize_reduce_op", (parts, 300, 4, 128)),
        ("reduce_requantize", ops.reduce_requantize, "_reduce_requantize_op",
         (parts, 300, 4, 128, 8, 256, True, 3, 7)),
    ]


CASES = _inputs()
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_public_function_matches_reference(case):
    name, public, _, args = case
    assert torch.equal(public(*args), getattr(reference, name)(*args))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck(case):
    """Schema, fake implementation and AOT dispatch agree with the real implementation."""
    _, _, op_name, args = case
    torch.library.opcheck(getattr(ops, op_name), args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_eager_skips_the_dispatcher(case, monkeypatch):
    name, public, op_name, args = case

    def refuse(*a):
        raise AssertionError("plain eager call went through the registered op")

    monkeypatch.setattr(ops, op_name, refuse)
    assert torch.equal(public(*args), getattr(reference, name)(*args))


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_modes_see_the_op(case):
    """Under a dispatch mode (as under make_fx, FakeTensor, profilers) the call is the op."""
    name, public, _, args = case
    with _Record() as rec:
        got = public(*args)
    assert f"qcoll.{name}" in rec.seen
    assert torch.equal(got, getattr(reference, name)(*args))


def test_compiled_round_trip_matches_eager():
    """torch.compile (fullgraph) traces through the ops' fake implementations."""
    def round_trip(x):
        packed = ops.quantize_rows(x, 4, 64, False, 0, 0)
        return packed, ops.dequantize_rows(packed, x.shape[1], 4, 64, torch.float32)

    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    packed, y = torch.compile(round_trip, fullgraph=True, backend="aot_eager")(x)
    want_packed, want_y = round_trip(x)
    assert torch.equal(packed, want_packed) and torch.equal(y, want_y)


def test_stream_handles_are_built_once_per_stream(monkeypatch):
    built = []

    class FakeExternalStream:
        def __init__(self, ptr, device_id):
            built.append((ptr, device_id))

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=FakeExternalStream))
    monkeypatch.setattr(launch, "_cupy", lambda: fake)
    monkeypatch.setattr(launch, "_streams", {})
    a = launch.cupy_stream(0, 1234)
    assert launch.cupy_stream(0, 1234) is a
    assert launch.cupy_stream(1, 1234) is not a
    assert built == [(1234, 0), (1234, 1)]
    for ptr in range(launch.MAX_STREAMS + 5):
        launch.cupy_stream(0, 10_000 + ptr)
    assert len(launch._streams) <= launch.MAX_STREAMS


def _round_trip(x):
    packed = ops.quantize_rows(x, 4, 64, False, 0, 0)
    return ops.dequantize_rows(packed, 200, 4, 64, torch.float32)  # (under jit.trace shapes are tensors)


def test_jit_trace_records_the_ops():
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    traced = torch.jit.trace(_round_trip, (x,), check_trace=False)
    graph = str(traced.graph)
    assert "qcoll::quantize_rows" in graph and "qcoll::dequantize_rows" in graph
    y = torch.randn(2, 200)
    assert torch.equal(traced(y), _round_trip(y))


def test_profiler_shows_the_ops():
    x = torch.randn(2, 200)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _round_trip(x)
    names = {e.key for e in prof.key_averages()}
    assert {"qcoll::quantize_rows", "qcoll::dequantize_rows"} <= names, sorted(names)
