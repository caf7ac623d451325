"""The model ``qcoll-bench serve`` serves: a small Hugging Face decoder from the model options,
written as a quantized-weights file (the format of :func:`qcoll.zero.export_quantized`) beside its
``config.json``, so that ``qcoll-serve`` and the benchmark load it as a user's exported model."""
from __future__ import annotations

import os

from ..weights import file as weights_file
from ..weights.record import QuantizedWeight
from .hf_decoder import build_decoder


def write_model(folder: str, args, positions: int, bits: int = 8, block: int = 256) -> tuple[str, str]:
    """Write ``model.safetensors`` and ``config.json`` into ``folder``: every parameter of two or more
    dimensions as ``bits``-bit codes in blocks of ``block`` (what qwZ sends and ``export_quantized``
    stores), the others plain, tied parameters once with an alias. Returns the two paths."""
    model = build_decoder(args, positions).eval()
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    weights, plain, aliases, first = {}, {}, {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in first:
            aliases[key] = first[id(value)]
            continue
        first[id(value)] = key
        if value.dim() >= 2:
            weights[key] = QuantizedWeight.from_tensor(value.detach(), bits, block)
        else:
            plain[key] = value.detach()
    path = os.path.join(folder, "model.safetensors")
    weights_file.save(path, weights, plain, aliases)
    return path, os.path.join(folder, "config.json")
