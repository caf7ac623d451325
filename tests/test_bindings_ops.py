"""qcoll.bindings.ops without a GPU: the custom ops' registration and tracing, the eager path.

The bindings are CUDA only: their ops are registered for CUDA and their implementations
launch kernels. To exercise everything but the kernels here, the ``cpu_stand_in`` fixture
registers each op's own implementation for CPU tensors too (for the test's duration) and
replaces the five launchers with stand-ins that write the torch reference's result into
the implementation's ``out``. So the schemas and fake implementations
(``torch.library.opcheck``), torch.compile, jit.trace, dispatch modes and the profiler run
through the real ops.py code; tests/test_cuda_kernels.py checks the kernels themselves.
"""
from __future__ import annotations

import ast
import pathlib
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qcoll.bindings import launch, ops
from qcoll.quant import reference

OP_NAMES = ("quantize_rows", "dequantize_rows", "swizzle_quantize", "dequantize_reduce", "reduce_requantize")


def _stand_ins(calls):
    """CPU stand-ins for the launchers: the reference's values written into ``out``; each call is
    appended to ``calls``."""
    def record(name, fn):
        def launcher(*args):
            calls.append(name)
            fn(*args)
        return launcher

    return {
        "quantize_rows_into": record("quantize_rows", lambda x, out, bits, block, st, seed, off: out.copy_(
            reference.quantize_rows(x, bits, block, st, seed, off))),
        "swizzle_quantize_into": record("swizzle_quantize", lambda x, out, nodes, local, s, bits, block, st, seed,
                                        off: out.copy_(reference.swizzle_quantize(x, nodes, local, bits, block, st,
                                                                                  seed, off))),
        "dequantize_rows_into": record("dequantize_rows", lambda buf, out, n, bits, block: out.copy_(
            reference.dequantize_rows(buf, n, bits, block, out.dtype))),
        "dequantize_reduce_into": record("dequantize_reduce", lambda bufs, out, n, bits, block: out.copy_(
            reference.dequantize_reduce(bufs, n, bits, block))),
        "reduce_requantize_into": record("reduce_requantize", lambda bufs, out, n, bi, bli, bo, blo, st, seed, off:
                                         out.copy_(reference.reduce_requantize(bufs, n, bi, bli, bo, blo, st, seed,
                                                                               off))),
    }


@pytest.fixture
def cpu_stand_in(monkeypatch):
    """The ops' implementations registered for CPU, the launchers replaced; yields the launch log."""
    calls = []
    for name, fn in _stand_ins(calls).items():
        monkeypatch.setattr(launch, name, fn)
    lib = torch.library.Library(ops.NAMESPACE, "IMPL")
    for name in OP_NAMES:
        lib.impl(name, getattr(ops, f"_{name}_impl"), "CPU")
    yield calls
    lib._destroy()


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
def test_public_function_allocates_and_launches_once(case, cpu_stand_in):
    """Each public function allocates the output the launcher fills (shape, dtype) and passes the
    arguments through in the launcher's order: one launch, the reference's bytes."""
    name, public, _, args = case
    assert torch.equal(public(*args), getattr(reference, name)(*args))
    assert cpu_stand_in == [name]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_opcheck(case, cpu_stand_in):
    """Schema, fake implementation and AOT dispatch agree with the real implementation."""
    _, _, op_name, args = case
    torch.library.opcheck(getattr(ops, op_name), args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_eager_skips_the_dispatcher(case, monkeypatch, cpu_stand_in):
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
def test_modes_see_the_op(case, cpu_stand_in):
    """Under a dispatch mode (as under make_fx, FakeTensor, profilers) the call is the op."""
    name, public, _, args = case
    with _Record() as rec:
        got = public(*args)
    assert f"qcoll.{name}" in rec.seen
    assert torch.equal(got, getattr(reference, name)(*args))


def test_compiled_round_trip_matches_eager(cpu_stand_in):
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


def test_jit_trace_records_the_ops(cpu_stand_in):
    x = torch.randn(2, 200, generator=torch.Generator().manual_seed(2))
    traced = torch.jit.trace(_round_trip, (x,), check_trace=False)
    graph = str(traced.graph)
    assert "qcoll::quantize_rows" in graph and "qcoll::dequantize_rows" in graph
    y = torch.randn(2, 200)
    assert torch.equal(traced(y), _round_trip(y))


def test_profiler_shows_the_ops(cpu_stand_in):
    x = torch.randn(2, 200)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _round_trip(x)
    names = {e.key for e in prof.key_averages()}
    assert {"qcoll::quantize_rows", "qcoll::dequantize_rows"} <= names, sorted(names)


def test_dequantize_rows_into_writes_out(cpu_stand_in):
    buf = reference.quantize_rows(torch.randn(2, 100), 4, 32)
    out = torch.full((2, 200), 7.0, dtype=torch.float16)[:, ::2]
    assert ops.dequantize_rows_into(buf, 100, 4, 32, out) is out
    assert torch.equal(out, reference.dequantize_rows(buf, 100, 4, 32, torch.float16))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_ops_are_registered_for_cuda_only(case):
    """Without the stand-in a CPU tensor reaching an op finds no kernel (no silent CPU fallback)."""
    _, _, op_name, args = case
    with pytest.raises(NotImplementedError, match="CPU"):
        getattr(ops, op_name)(*args)


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names.update(base + ("" if base.endswith(".") else ".") + a.name for a in node.names)
    return names


def test_bindings_and_reference_do_not_import_each_other():
    """bindings knows the wire format's constants (qcoll.quant.format), not the codec's torch code;
    the reference imports neither the bindings nor the compiled path."""
    bindings = pathlib.Path(ops.__file__).parent
    for path in bindings.glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("qcoll.quant") and not m.startswith("qcoll.quant.format")}
        assert not bad, (path.name, bad)
    ref = _imports(pathlib.Path(reference.__file__))
    banned = {"compiled", "cpu", "bindings", "rows"}   # module names, not substrings (hadamard_rows is fine)
    assert not {m for m in ref if banned & set(m.split("."))}, ref
