"""ONNX export of a model whose parameters are :class:`QuantizedWeight` codes (the external
format, see ``docs/EXPORT.md``): ``onnxruntime.InferenceSession`` runs the file as it is.

Each quantized parameter of ``shape`` becomes, in place of its float initializer::

    codes  [num_blocks, block_size]  INT8 (bits 8, 6), INT4 (bits 4; bits 2 below opset 25)
                                     or INT2 (bits 2, opset >= 25)
    scales [num_blocks]              FLOAT
    zero   [num_blocks]              zeros, the codes' type
    DequantizeLinear(codes, scales, zero, axis=0)  -> FLOAT [num_blocks, block_size] = q * scale
    [Clip(-FLT_MAX, FLT_MAX)]                      only where q * scale overflows (the codec saturates)
    Reshape [-1] -> Slice [0, numel) -> Reshape shape   (one Reshape when there is no padding)
    [Cast dtype] [Cast initializer dtype]          when the forward's dtype is not fp32

so the graph sees exactly ``QuantizedWeight.dequantize()``, bit for bit. INT4 and INT2 pack
two and four codes per byte with the first code in the low bits, as the codec does, so their
bytes are the record's ``codes`` unchanged.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

import numpy as np
import torch

from .record import QuantizedWeight

_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16}  # TensorProto.FLOAT, FLOAT16, BFLOAT16
_TORCH_TYPES = {v: k for k, v in _ONNX_TYPES.items()}
_FLT_MAX = float(torch.finfo(torch.float32).max)


def _require(*names: str):
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise ImportError(f"qcoll.weights.onnx needs {' and '.join(missing)} (the 'onnx' extra: "
                          f"pip install 'qcoll[onnx]', which also brings onnxruntime to run the file)")
    return [importlib.import_module(n) for n in names]


def dequantize_nodes(qw: QuantizedWeight, name: str, out_dtype: torch.dtype | None = None, opset: int = 21):
    """The nodes and initializers that compute ``qw.dequantize()`` as tensor ``name``.

    Returns ``(nodes, initializers)``: ``name`` is ``qw.shape`` in ``out_dtype`` (default
    ``qw.dtype``), the values ``q * scale`` in fp32 cast to ``qw.dtype``, then to ``out_dtype``.
    Needs ``opset >= 21`` (INT4 and per-axis DequantizeLinear); 2-bit codes are stored as INT2
    (the record's bytes) from opset 25 on and as INT4 below it.
    """
    (onnx,) = _require("onnx")
    from onnx import helper, numpy_helper
    if opset < 21:
        raise ValueError(f"opset must be >= 21 (INT4 DequantizeLinear), got {opset}")
    nb, bs, n = qw.num_blocks, qw.block_size, qw.numel
    shape = [int(d) for d in qw.shape]
    p = f"{name}::qcoll_"
    int2 = getattr(onnx.TensorProto, "INT2", None) if opset >= 25 else None   # onnx >= 1.21
    if qw.bits == 4 or (qw.bits == 2 and int2):          # the record's packing is ONNX's
        kind = onnx.TensorProto.INT4 if qw.bits == 4 else int2
        codes = helper.make_tensor(p + "codes", kind, [nb, bs], qw.codes.cpu().numpy().tobytes(), raw=True)
    elif qw.bits == 2:                                    # 2-bit codes repacked two per byte
        q = qw.int_codes().cpu().view(torch.uint8)
        packed = ((q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)).numpy().tobytes()
        codes = helper.make_tensor(p + "codes", onnx.TensorProto.INT4, [nb, bs], packed, raw=True)
    else:
        codes = numpy_helper.from_array(qw.int_codes().cpu().numpy(), p + "codes")
    scales = qw.scales.cpu()
    inits = [codes, numpy_helper.from_array(scales.numpy(), p + "scales")]
    nodes = []

    def add(op, inputs, attrs=None, **consts):   # a node reading inputs, then int64 (fp32 for Clip) constants
        dt = np.float32 if op == "Clip" else np.int64
        inits.extend(numpy_helper.from_array(np.asarray(c, dtype=dt), p + k) for k, c in consts.items())
        node = helper.make_node(op, [*inputs, *(p + k for k in consts)], [f"{p}{len(nodes)}"], **(attrs or {}))
        nodes.append(node)
        return node.output[0]

    # an explicit zero point: onnxruntime 1.24-1.26 otherwise requantize a single-block tensor as uint8
    # (QDQ propagation past the Reshape), turning its negative values into 0
    width = {onnx.TensorProto.INT8: 8, onnx.TensorProto.INT4: 4}.get(codes.data_type, 2)
    inits.append(helper.make_tensor(p + "zero", codes.data_type, [nb], bytes(-(-nb * width // 8)), raw=True))
    x = add("DequantizeLinear", [p + "codes", p + "scales", p + "zero"], {"axis": 0})   # [num_blocks, block_size]
    if nb and torch.isinf(qw.int_codes().cpu().float() * scales[:, None]).any():
        x = add("Clip", [x], lo=-_FLT_MAX, hi=_FLT_MAX)
    if nb * bs != n:
        x = add("Slice", [add("Reshape", [x], flat=[-1])], start=[0], end=[n])
    x = add("Reshape", [x], shape=shape)
    if qw.dtype != torch.float32:
        x = add("Cast", [x], {"to": _ONNX_TYPES[qw.dtype]})
    if (out_dtype or qw.dtype) != qw.dtype:
        x = add("Cast", [x], {"to": _ONNX_TYPES[out_dtype]})
    nodes[-1].output[0] = name
    return nodes, inits


def replace_initializers(proto, params: list[list[str]], weights: dict[str, QuantizedWeight],
                         plain: dict[str, torch.Tensor] | None = None):
    """Put the codes of ``weights`` (and the values of ``plain``) into ``proto`` (an
    ``onnx.ModelProto``, changed in place and returned) in place of the float initializers.

    ``params`` lists each parameter's names (tied parameters: one list with all its names).
    Every parameter needs an entry in ``weights`` or ``plain`` under one of its names, and an
    initializer of one of its names and its shape in the graph; anything else raises, naming it.
    """
    (onnx,) = _require("onnx")
    from onnx import helper
    plain = plain or {}
    graph = proto.graph
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    if weights and opset < 21:
        raise ValueError(f"the graph's opset is {opset}; the codes need opset >= 21 (export with opset_version=21)")
    inits = {t.name: t for t in graph.initializer}
    replaced, new_nodes, new_inits = {}, [], []      # initializer name -> its new TensorProto, or None (dropped)
    for names, q, v in _match(params, weights, plain):
        what = _what(names)
        found = [n for n in names if n in inits]
        if not found:
            raise ValueError(f"parameter {what}: the exported graph has no initializer of that name (the exporter "
                             "renamed, folded or transposed it, or the forward does not use it); its codes cannot "
                             "be placed")
        shape = tuple(q.shape) if q is not None else tuple(v.shape)
        for n in found:
            t = inits[n]
            if tuple(t.dims) != shape or t.data_type not in _TORCH_TYPES:
                raise ValueError(f"parameter {what}: the graph's initializer {n} is "
                                 f"{_TORCH_TYPES.get(t.data_type, t.data_type)} {tuple(t.dims)}, "
                                 f"expected a float tensor of shape {shape}")
            if v is not None:   # the value, in the graph's dtype for it
                data = v.detach().to("cpu", _TORCH_TYPES[t.data_type]).contiguous().view(torch.uint8)
                replaced[n] = helper.make_tensor(n, t.data_type, t.dims, data.numpy().tobytes(), raw=True)
        if q is not None:
            nodes, extra = dequantize_nodes(q, found[0], _TORCH_TYPES[inits[found[0]].data_type], opset)
            new_nodes += nodes + [helper.make_node("Identity", [found[0]], [n]) for n in found[1:]]
            new_inits += extra
            replaced.update(dict.fromkeys(found))
    kept = [replaced.get(t.name, t) for t in graph.initializer]
    graph.ClearField("initializer")
    graph.initializer.extend([t for t in kept if t is not None] + new_inits)
    dequantized = {n for n, t in replaced.items() if t is None}
    inputs = [i for i in graph.input if i.name not in dequantized]   # IR < 4 lists initializers as inputs too
    graph.ClearField("input")
    graph.input.extend(inputs)
    int2 = getattr(onnx.TensorProto, "INT2", None)
    if new_inits:   # INT4 needs IR version 10, INT2 13
        proto.ir_version = max(proto.ir_version, 13 if any(t.data_type == int2 for t in new_inits) else 10)
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend(new_nodes + nodes)         # the new nodes read initializers only: still topological
    return proto


def _what(names: list[str]) -> str:
    return names[0] + (f" (tied: {', '.join(names[1:])})" if len(names) > 1 else "")


def _match(params: list[list[str]], weights: dict, plain: dict) -> list[tuple]:
    """``(names, QuantizedWeight or None, value or None)`` for each parameter; raises on a name that
    is no parameter, a parameter in neither or both dicts, tied names with different codes."""
    known = {n for names in params for n in names}
    for key in [*weights, *plain]:
        if key not in known:
            raise KeyError(f"{key!r} is not a parameter of the model")
    out = []
    for names in params:
        q = [weights[n] for n in names if n in weights]
        v = [plain[n] for n in names if n in plain]
        if not q and not v:
            raise KeyError(f"parameter {_what(names)} has no QuantizedWeight in weights and no value in plain")
        if q and v:
            raise ValueError(f"parameter {_what(names)} is in both weights and plain")
        if any(not _same(q[0], o) for o in q[1:]):
            raise ValueError(f"parameter {_what(names)}: its tied names carry different codes")
        out.append((names, q[0] if q else None, v[0] if v else None))
    return out


def _same(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    meta = (a.shape, a.dtype, a.bits, a.block_size) == (b.shape, b.dtype, b.bits, b.block_size)
    return a is b or (meta and torch.equal(a.codes, b.codes)
                      and torch.equal(a.scales.view(torch.int32), b.scales.view(torch.int32)))


#: the model property holding the decoder's longest sequence (``config.max_position_embeddings``)
MAX_POSITIONS_KEY = "qcoll.max_positions"


def export_onnx(model: torch.nn.Module, example_inputs: tuple, weights: dict[str, QuantizedWeight], path: str,
                plain: dict[str, torch.Tensor] | None = None, *, opset: int = 21, **export_kwargs):
    """Export ``model`` to the ONNX file ``path`` with every parameter's codes as ``weights`` holds them.

    ``model``'s forward on ``example_inputs`` is traced by ``torch.onnx.export(dynamo=True,
    optimize=False)`` (``export_kwargs`` go to it: ``input_names``, ``output_names``,
    ``dynamic_shapes``, ...), in eval mode and, for a model whose ``config.use_cache`` is set (a
    Hugging Face decoder's default), with ``use_cache=False``: the forward's output is then its
    logits, not a cache object the exporter refuses. Both are restored afterwards, also when the
    export fails. When ``example_inputs`` is one integer ``[batch, seq]`` tensor (a decoder's token
    ids), the defaults give the file ``qcoll-serve`` serves: input ``input_ids`` with dynamic
    ``batch`` and ``seq`` axes (``dynamic_shapes``; the example is repeated to at least 2 x 2 for
    the trace, as torch.export fixes axes of size 1), first output ``logits``; any of
    ``input_names``, ``output_names``, ``dynamic_shapes`` passed replaces its default.

    ``weights`` maps parameter names (``model.named_parameters()``; a tied parameter under any of
    its names) to their :class:`QuantizedWeight`: codes ``[num_blocks, block_size]`` (INT8, INT4 or
    INT2) and fp32 scales ``[num_blocks]`` in the file; ``plain`` maps the parameters kept
    unquantized to their values (stored in the graph's dtype for them). Every parameter must be in
    exactly one of the two. ``plain`` may also hold the model's buffers (``qcoll.weights.read``'s
    plain tensors are parameters and buffers): the graph takes a buffer from the model, so its
    value there must equal the model's (else a ValueError names it). Parameters the exporter
    renamed, folded or transposed raise a ValueError naming them. Files over 1.5 GiB keep their
    tensors in ``path + ".data"`` beside it. Returns the ``onnx.ModelProto``.
    """
    onnx, _ = _require("onnx", "onnxscript")
    groups: dict[int, list[str]] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(prm), []).append(n)
    plain = _without_buffers(model, plain or {})
    _match(list(groups.values()), weights, plain)   # before the (slow) export
    example_inputs = _decoder_defaults(tuple(example_inputs), export_kwargs)
    export_kwargs.setdefault("optimize", False)   # the optimizer folds parameters into new constants
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    modes = [(m, m.training) for m in model.modules()]
    try:
        if use_cache:   # the forward would return a cache object (DynamicCache), which no exporter takes
            config.use_cache = False
        model.eval()
        program = torch.onnx.export(model, example_inputs, dynamo=True, opset_version=opset, **export_kwargs)
    finally:
        if use_cache:
            config.use_cache = use_cache
        for m, training in modes:
            m.training = training
    proto = replace_initializers(program.model_proto, list(groups.values()), weights, plain)
    for node in proto.graph.node:   # the exporter's debug notes (stack traces, fx nodes): 80% of a small file
        node.ClearField("metadata_props")
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(positions, int) and positions > 0:   # what a server may accept (qcoll.serve.OnnxRunner)
        onnx.helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props},
                                            MAX_POSITIONS_KEY: str(positions)})
    big = sum(len(t.raw_data) for t in proto.graph.initializer) > 1.5 * 2**30
    onnx.save_model(proto, os.fspath(path), save_as_external_data=big, all_tensors_to_one_file=True,
                    location=os.path.basename(os.fspath(path)) + ".data")
    onnx.checker.check_model(os.fspath(path))
    return proto


def _without_buffers(model: torch.nn.Module, plain: dict) -> dict:
    """``plain`` less the model's buffers, each checked to equal the model's (the graph's) value."""
    buffers = dict(model.named_buffers(remove_duplicate=False))
    for key, value in plain.items():
        if key in buffers:
            b = buffers[key]
            if tuple(value.shape) != tuple(b.shape) or not torch.equal(value.detach().to(b.device, b.dtype), b):
                raise ValueError(f"buffer {key!r}: plain holds other values than the model's, which the graph "
                                 "takes (load the file into the model first: qcoll.weights.load_quantized)")
    return {k: v for k, v in plain.items() if k not in buffers}


def _decoder_defaults(example_inputs: tuple, export_kwargs: dict) -> tuple:
    """For one integer ``[batch, seq]`` example (token ids): the names and dynamic axes that
    ``qcoll-serve`` (``OnnxRunner``) needs, set in ``export_kwargs`` unless given; returns the example
    to trace, repeated to at least 2 x 2 when dynamic axes are defaulted."""
    ids = example_inputs[0] if len(example_inputs) == 1 else None
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()
            and not ids.is_complex() and ids.dtype != torch.bool):
        return example_inputs
    export_kwargs.setdefault("input_names", ["input_ids"])
    export_kwargs.setdefault("output_names", ["logits"])
    if "dynamic_shapes" in export_kwargs or "dynamic_axes" in export_kwargs:
        return example_inputs
    batch, seq = ids.shape
    if not batch or not seq:
        raise ValueError(f"example input_ids of shape {tuple(ids.shape)}: the trace needs at least one token")
    # torch.export specializes an axis of size 1 (a named Dim then fails the export; Dim.DYNAMIC
    # gives a graph that breaks at other sizes): the trace runs on >= 2 prompts of >= 2 tokens
    ids = ids.repeat(1 if batch > 1 else 2, 1 if seq > 1 else 2)
    export_kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")},)
    return (ids,)


__all__ = ["export_onnx", "replace_initializers", "dequantize_nodes"]
