"""The path docs/EXPORT.md gives a user, end to end: the quantized-weights file of a Hugging Face
decoder (its config as it comes: ``use_cache=True``) -> ``export_onnx`` with its defaults ->
the server ``qcoll-serve model.onnx`` builds (its argument parser and ``build_server``, under uvicorn
in a thread on an ephemeral port: no port race with other tests) -> ``POST /v1/logits`` over HTTP,
against the logits of the file loaded by ``qcoll.weights.load_quantized`` (the serve tests' oracle)."""
import argparse
import concurrent.futures as cf
import os
import re
import shlex
import warnings

import numpy as np
import pytest

pytest.importorskip("onnx", reason="onnx not installed (the 'onnx' extra)")
pytest.importorskip("onnxruntime", reason="onnxruntime not installed (the 'onnx' extra)")
pytest.importorskip("onnxscript", reason="onnxscript not installed (the 'onnx' extra)")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

import qcoll.weights  # noqa: E402
from qcoll.bench.hf_decoder import build_decoder  # noqa: E402
from qcoll.bench.serve_model import write_model  # noqa: E402

from qcoll.serve import build_app, cli  # noqa: E402

from serve_helpers import MODEL_ARGS, POSITIONS, call, serving  # noqa: E402

# one token, the example's length and others; two of one length (one forward with batch 2)
PROMPTS = [[5], [1, 2, 3, 4], [7, 8, 9], [3, 4, 5, 6, 7, 8, 9], [200, 9, 9], [11] * 20]
DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "EXPORT.md")
DECODERS = {"gpt2": MODEL_ARGS, "llama": argparse.Namespace(**{**vars(MODEL_ARGS), "arch": "llama", "heads": 4})}


def _recipe() -> tuple[str, list[str]]:
    """docs/EXPORT.md's recipe: its python block, and its ``qcoll-serve`` line's arguments."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## External format: ONNX"):]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    recipe = blocks[0][1]
    assert blocks[0][0] == "python" and "export_onnx(" in recipe, blocks[0]
    (line,) = [ln for ln in blocks[1][1].splitlines() if ln.startswith("qcoll-serve ")]
    return recipe, shlex.split(line)[1:]


# GPT-2 under pytest -m long: its export through onnxruntime is test_weights_onnx.py's, and qcoll-serve
# serving it test_serve_http.py's; Llama (RMSNorm, rotary embeddings) is exported and served only here
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.long) if a == "gpt2" else a
                                  for a in sorted(DECODERS)])
def test_default_export_is_served_by_qcoll_serve(arch, tmp_path, monkeypatch):
    """docs/EXPORT.md's recipe, its very text (run here in a folder holding the decoder's
    quantized-weights file and config.json), then the server its ``qcoll-serve`` command builds.

    Tolerance: the weights in onnxruntime are the file's values bit for bit
    (test_weights_onnx), so the logits differ only by the kernels' summation order and fusions: a
    few fp32 ulps per dot product (<= 256 terms) through 2 layers. Measured max |diff| 1.0-1.8e-7
    on logits of magnitude 0.4-0.9 for both decoders (ulp(0.5) = 6e-8); the bound, 1e-5 relative to
    max(1, |logits|), is 50x that, and the quantization moves these logits by 5-8e-3, 500x it
    (checked below against the unquantized decoder), so a wrong or unquantized weight fails."""
    args = DECODERS[arch]
    write_model(str(tmp_path), args, POSITIONS)   # model.safetensors + config.json, as a user has them
    monkeypatch.chdir(tmp_path)
    assert transformers.AutoConfig.from_pretrained("config.json").use_cache   # the default, kept in the file
    recipe, argv = _recipe()
    scope = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                              # the exporter's deprecation notes
        exec(compile(recipe, "docs/EXPORT.md", "exec"), scope)      # noqa: S102 (the repository's own text)
    model = scope["model"]
    assert model.config.use_cache and model.training                 # export_onnx gave both back

    oracle = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained("config.json"))
    qcoll.weights.load_quantized("model.safetensors", oracle).eval()
    exact = build_decoder(args, POSITIONS).eval()                    # the same decoder before quantization
    with torch.no_grad():
        want = [oracle(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]
        unquantized = [exact(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS]

    # what qcoll-serve does with the doc's arguments, up to uvicorn.run(host, port)
    server = cli.build_server(cli.build_parser().parse_args(argv))   # refused before: no dynamic axes
    with serving(build_app(server)) as url, cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: call(url + "/v1/logits", {"prompt": p}), PROMPTS))
        # the file records the decoder's positions: a longer prompt is the client's error, not onnxruntime's
        status, doc, _ = call(url + "/v1/logits", {"prompt": [3] * (POSITIONS + 1)})
        assert status == 422 and f"at most {POSITIONS} positions" in doc["error"], (status, doc)
    for prompt, w, u, (status, doc, _) in zip(PROMPTS, want, unquantized, answers):
        assert status == 200, (prompt, doc)
        got = np.float32(doc["logits"])
        assert got.shape == (args.vocab,)
        bound = 1e-5 * max(1.0, float(np.abs(w).max()))
        assert np.abs(got - w).max() <= bound, (prompt, np.abs(got - w).max())
        assert np.abs(u - w).max() > 100 * bound, prompt              # the quantization is visible at it
