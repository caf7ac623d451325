"""qcoll.weights.onnx: the external format. The codes and scales in an ONNX file that
onnxruntime runs as it is, dequantized there bit for bit as ``QuantizedWeight.dequantize()``."""
import os
import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="onnx not installed (the 'onnx' extra)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime not installed (the 'onnx' extra)")
pytest.importorskip("onnxscript", reason="onnxscript not installed (the 'onnx' extra; torch.onnx.export needs it)")

from onnx import helper  # noqa: E402

from qcoll.weights import QuantizedWeight  # noqa: E402
from qcoll.weights.onnx import dequantize_nodes, export_onnx, replace_initializers  # noqa: E402

FLT_MAX = torch.finfo(torch.float32).max


def _session(model_or_path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3   # the exporter's graph makes onnxruntime warn about CastLike folding
    src = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else model_or_path
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def _version(module) -> tuple[int, int]:
    return tuple(int(v) for v in module.__version__.split(".")[:2])


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    """fp32 bit patterns, every NaN as one pattern (the codec promises NaN-ness, not NaN bits)."""
    return torch.where(t.isnan(), torch.full_like(t, float("nan")), t).view(torch.int32)


@pytest.mark.parametrize("bits,opset", [(8, 21), (6, 21), (4, 21), (2, 21), (2, 25)])
def test_dequantize_subgraph_bit_identical(bits, opset):
    """DequantizeLinear(axis=0) + Reshape/Slice in onnxruntime == QuantizedWeight.dequantize(), bit for bit:
    block sizes 32..4096, odd and empty shapes, bf16/fp16 forwards, a NaN block and a block whose
    q * scale overflows fp32 (the codec saturates it to FLT_MAX)."""
    if opset >= 25 and (not hasattr(onnx.TensorProto, "INT2") or _version(ort) < (1, 27)):
        pytest.skip("opset 25 with INT2 codes needs onnx >= 1.21 and onnxruntime >= 1.27 (checked there)")
    torch.manual_seed(bits)
    cases, nodes, inits, outs = [], [], [], []
    for block in (32, 256, 4096):
        for shape in [(3, 50), (1000,), (7, 5, 33), (), (0,), (64, 128)]:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = torch.randn(shape) * torch.rand(shape) * 3
                if x.numel() >= 64:
                    x.view(-1)[5], x.view(-1)[40], x.view(-1)[-1] = FLT_MAX, float("nan"), 0.0
                qw = QuantizedWeight.from_tensor(x.to(dtype), bits, block)
                name = f"y{len(cases)}"
                n, i = dequantize_nodes(qw, name, torch.float32, opset)   # fp32 output: bf16 -> fp32 is exact
                nodes += n
                inits += i
                outs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(qw.shape)))
                cases.append(qw)
    graph = helper.make_graph(nodes, "dequantize", [], outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=10 if opset < 25 else 13)   # INT4 needs 10, INT2 13
    onnx.checker.check_model(model, full_check=True)
    got = _session(model).run(None, {})
    if bits in (8, 6):   # q * scale overflows in the FLT_MAX blocks at 8 and 6 bits
        assert any(n.op_type == "Clip" for n in nodes)
    for qw, y in zip(cases, got):
        want = qw.dequantize().float()
        y = torch.from_numpy(y)
        assert y.shape == want.shape
        assert torch.equal(_bits_of(y), _bits_of(want)), (qw.shape, qw.dtype, qw.block_size)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _default_gpt2():
    """A tiny GPT-2 with Hugging Face's defaults otherwise: use_cache=True, dropout 0.1, training mode."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


# 8 bits under pytest -m long: its dequantize subgraph is checked bit for bit by the test above, and the
# whole path at 4 bits (sub-byte codes unpacked in the graph) here
@pytest.mark.parametrize("bits", [pytest.param(8, marks=pytest.mark.long), 4])
def test_gpt2_logits_through_onnxruntime(bits, tmp_path):
    """A tiny default GPT-2 (tied embedding and head; use_cache=True, dropout, training mode as
    built) whose parameters are their 256-blocks' codes, exported with export_onnx's defaults:
    torch (eval) on the dequantized values vs onnxruntime on the exported codes, at the example's
    shape and at another batch and length (the default dynamic axes, named as qcoll-serve needs).

    The weights are bit-identical in both (the test above), so the logits differ only by the
    kernels' summation order and fusions (onnxruntime fuses LayerNorm, GELU, MatMul+Add): a few
    fp32 ulps per dot product of <= 256 terms, through 2 layers. Observed max |diff| 3e-7 on
    logits of magnitude ~1; the tolerance is 1e-5, 30x that and still 100x below the effect of
    the quantization itself (checked, so a parameter left unquantized or misplaced would fail)."""
    model = _default_gpt2()
    assert model.training and model.config.use_cache
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    other = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(3))
    weights = {n: QuantizedWeight.from_tensor(p.detach(), bits, 256) for n, p in model.named_parameters()}
    with torch.no_grad():
        model.eval()
        exact = model(ids, use_cache=False).logits
        for n, p in model.named_parameters():
            p.copy_(weights[n].dequantize())
        want = [model(x, use_cache=False).logits.numpy() for x in (ids, other)]
        model.train()
    path = tmp_path / "gpt2.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proto = export_onnx(model, (ids,), weights, path)
    assert model.training and model.config.use_cache   # restored
    session = _session(str(path))
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("input_ids", ["batch", "seq"])]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    got = [session.run(["logits"], {"input_ids": x.numpy()})[0] for x in (ids, other)]
    for g, w in zip(got, want):
        assert g.shape == w.shape
        diff = float(np.abs(g - w).max())
        assert diff <= 1e-5, diff
    assert float((exact - torch.from_numpy(got[0])).abs().max()) > 1e-3   # quantization is visible at this tolerance

    # size: the codes (1 or 1/2 byte a value, padding included) and fp32 scales, no float copy of any parameter
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert not [t.name for t in proto.graph.initializer if t.name in names]
    blocks = sum(-(-w.numel // 256) for w in weights.values())
    expected = blocks * (256 * bits // 8 + 4)
    P = sum(w.numel for w in weights.values())
    assert expected <= P * bits / 8 + 4 * P / 256 + len(weights) * (256 * bits // 8 + 4)   # padding: < a block each
    quantized = sum(len(t.raw_data) for t in proto.graph.initializer if "::qcoll_codes" in t.name or
                    "::qcoll_scales" in t.name)
    assert quantized == expected
    size = os.path.getsize(path)
    # the rest is the graph (~490 nodes; measured 61 KiB), which does not grow with the parameters
    assert size <= expected + 100 * 1024, (size, expected)


def test_export_traces_a_default_decoder_and_restores_it(monkeypatch, tmp_path):
    """What export_onnx hands torch.onnx.export for a default decoder and token ids: the model in
    eval mode with use_cache off (its cache object is no exportable output), input_ids /
    logits with dynamic batch and seq axes, a 1 x 1 example repeated to 2 x 2 (torch.export fixes
    axes of size 1); names or dynamic_shapes given replace the defaults; and the model comes back
    as it was (training, use_cache) even when the exporter raises."""
    model = _default_gpt2()
    weights = {n: QuantizedWeight.from_tensor(p.detach(), 8, 256) for n, p in model.named_parameters()}
    seen = []

    def failing_export(m, args, **kw):
        seen.append(dict(training=[x.training for x in m.modules()], use_cache=m.config.use_cache,
                         shape=tuple(args[0].shape), kw=kw))
        raise RuntimeError("the exporter failed")

    monkeypatch.setattr(torch.onnx, "export", failing_export)
    for ids, kw in [(torch.tensor([[5]]), {}), (torch.ones(3, 4, dtype=torch.int64), {"input_names": ["tokens"],
                                                                                      "dynamic_shapes": None})]:
        with pytest.raises(RuntimeError, match="the exporter failed"):
            export_onnx(model, (ids,), weights, tmp_path / "m.onnx", **kw)
        assert model.config.use_cache and all(m.training for m in model.modules())
    default, given = seen
    assert not any(default["training"]) and default["use_cache"] is False
    assert default["shape"] == (2, 2)
    assert default["kw"]["input_names"] == ["input_ids"] and default["kw"]["output_names"] == ["logits"]
    (axes,) = default["kw"]["dynamic_shapes"]
    assert {a: d.__name__ for a, d in axes.items()} == {0: "batch", 1: "seq"}
    assert given["shape"] == (3, 4) and given["kw"]["dynamic_shapes"] is None
    assert given["kw"]["input_names"] == ["tokens"] and given["kw"]["output_names"] == ["logits"]
    with pytest.raises(ValueError, match=r"example input_ids of shape \(1, 0\)"):
        export_onnx(model, (torch.zeros(1, 0, dtype=torch.int64),), weights, tmp_path / "m.onnx")


class _Folded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 64))
        self.b = torch.nn.Parameter(torch.randn(8))
        self.register_buffer("s", torch.full((8,), 2.0))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w * 2) + self.b * self.s


def _export(model, weights, tmp_path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return export_onnx(model, (torch.randn(2, 64),), weights, tmp_path / "m.onnx", **kw)


def test_unmatched_parameters_raise(tmp_path):
    """A parameter whose codes cannot be placed (the exporter folded it into a new constant, or
    it has no codes) or a name that is no parameter raises, naming it; never left unquantized.
    A buffer in plain (qcoll.weights.read's plain tensors include the file's buffers) is taken
    when it equals the model's, which the graph holds, and raises otherwise."""
    model = _Folded()
    model.w2 = model.w   # tied: one parameter, two names, which must carry the same codes
    weights = {n: QuantizedWeight.from_tensor(p.detach(), 8, 32) for n, p in model.named_parameters()}
    # the names are checked before the export
    with pytest.raises(KeyError, match=r"parameter b has no QuantizedWeight"):
        _export(model, {"w": weights["w"]}, tmp_path)
    with pytest.raises(KeyError, match=r"'bias' is not a parameter"):
        _export(model, {**weights, "bias": weights["b"]}, tmp_path)
    with pytest.raises(ValueError, match=r"parameter w \(tied: w2\) is in both"):
        _export(model, weights, tmp_path, plain={"w2": model.w.detach()})
    other = QuantizedWeight.from_tensor(model.w.detach() * 2, 8, 32)
    with pytest.raises(ValueError, match=r"parameter w \(tied: w2\): its tied names carry different codes"):
        _export(model, {**weights, "w2": other}, tmp_path)
    with pytest.raises(ValueError, match=r"buffer 's': plain holds other values than the model's"):
        _export(model, {"w": weights["w"]}, tmp_path, plain={"b": torch.zeros(8), "s": torch.ones(8)})
    # optimize=False keeps the parameters' names: fine; b kept as a plain fp32 value, the buffer s as the model's
    proto = _export(model, {"w": weights["w"], "w2": weights["w"]}, tmp_path,
                    plain={"b": torch.zeros(8), "s": model.s.clone()})
    (b,) = [t for t in proto.graph.initializer if t.name == "b"]
    assert onnx.numpy_helper.to_array(b).tolist() == [0.0] * 8
    assert not [t.name for t in proto.graph.initializer if t.name in ("w", "w2")]
    with pytest.raises(ValueError, match=r"parameter w \(tied: w2\): the exported graph has no initializer"):
        _export(model, weights, tmp_path, optimize=True)   # the optimizer folds w * 2 into a constant


def test_tied_names_both_in_the_graph():
    """A graph holding a tied parameter under both its names (GPT-2's exporter keeps one) gets one
    set of codes, the other name an Identity of it; the graph's fp16 initializer gets a Cast."""
    x = torch.randn(3, 40)
    qw = QuantizedWeight.from_tensor(x, 4, 32)
    inits = [onnx.numpy_helper.from_array(x.numpy(), "a"), onnx.numpy_helper.from_array(x.numpy(), "b"),
             onnx.numpy_helper.from_array(x.half().numpy(), "c")]
    nodes = [helper.make_node("Add", ["a", "b"], ["ab"]), helper.make_node("Cast", ["c"], ["c32"], to=1),
             helper.make_node("Add", ["ab", "c32"], ["y"])]
    graph = helper.make_graph(nodes, "tied", [], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 40])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    replace_initializers(model, [["a", "b"], ["c"]], {"b": qw, "c": QuantizedWeight.from_tensor(x, 8, 32)})
    assert not {t.name for t in model.graph.initializer} & {"a", "b", "c"}
    assert sum(t.name.endswith("::qcoll_codes") for t in model.graph.initializer) == 2
    onnx.checker.check_model(model, full_check=True)
    (y,) = _session(model).run(None, {})
    c = QuantizedWeight.from_tensor(x, 8, 32).dequantize().half().float()
    assert torch.equal(torch.from_numpy(y), qw.dequantize() + qw.dequantize() + c)


def _sharded_gpt2_export(rank, world, path, bits):
    import qcoll
    from qcoll import zero

    m = zero.shard(_gpt2(), qcoll.Topology(1), zero.ZeroConfig(weight_bits=bits, hpz=False, grad_bits=4))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = m(ids).logits
    zero.export_quantized(m, path)
    return logits, ids


def test_sharded_training_model_round_trips_through_onnxruntime(ranks2, tmp_path):
    """The whole path: a sharded GPT-2's quantized forward -> export_quantized (safetensors) ->
    a plain model from the file -> ONNX -> onnxruntime: its logits are the sharded forward's
    within the kernels' summation-order tolerance of the test above."""
    from qcoll import weights

    st = str(tmp_path / "gpt2.safetensors")
    logits, ids = ranks2.run(_sharded_gpt2_export, st, 4, timeout=120)[0]
    qw, _, _, _ = weights.read(st)
    plain = weights.load_quantized(st, _gpt2())
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, logits)
    path = str(tmp_path / "gpt2.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(plain, (ids,), qw, path, input_names=["input_ids"], output_names=["logits"])
    (got,) = _session(path).run(["logits"], {"input_ids": ids.numpy()})
    assert float(np.abs(got - logits.numpy()).max()) <= 1e-5
