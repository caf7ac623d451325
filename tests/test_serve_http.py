"""qcoll.serve over HTTP: the exported model's logits (bit for bit unbatched, to float32 rounding
batched), greedy generation, bad requests answered 4xx while the server keeps serving, overload
shed with 503s, the static-config endpoint."""
import concurrent.futures as cf
import os
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

from qcoll.bench.serve_model import write_model  # noqa: E402
from qcoll.serve import BatchConfig, Server, SloScheduler, build_app, load_runner  # noqa: E402
from qcoll.serve.runner import TorchRunner  # noqa: E402
from qcoll.weights import load_quantized  # noqa: E402

from serve_helpers import MODEL_ARGS, POSITIONS, call, serving  # noqa: E402

PROMPTS = [[3, 4, 5, 6], [7, 8, 9, 10], [11, 12], [5] * 20, [200], [9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8]] * 2


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("served")), MODEL_ARGS, POSITIONS)


@pytest.fixture(scope="module")
def oracle(exported):
    """The exported file loaded into a fresh model by qcoll.weights.load_quantized, run one prompt at a time."""
    path, config = exported
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(config))
    load_quantized(path, model).eval()

    def logits(prompt):
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0, -1].numpy()
    return logits


CORES = min(2, os.cpu_count() or 1)   # PUT /admin/config takes at most this machine's cores


@pytest.fixture(scope="module")
def static_url(exported):
    server = Server(load_runner(*exported), BatchConfig(max_batch_size=8, batch_wait_timeout_s=0.05, workers=CORES,
                                                        intra_op_threads=CORES), admin=True)
    with serving(build_app(server)) as url:
        yield url


def _concurrently(url, bodies):
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: call(url, b), bodies))


@pytest.mark.parametrize("config", [dict(max_batch_size=8, batch_wait_timeout_s=0.05, workers=CORES,
                                         intra_op_threads=CORES),
                                    dict(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1)])
def test_logits_are_the_exported_models_bit_for_bit(static_url, oracle, config):
    status, _, _ = call(static_url + "/admin/config", config, method="PUT")
    assert status == 200
    answers = _concurrently(static_url + "/v1/logits", [{"prompt": p} for p in PROMPTS])
    for prompt, (status, doc, _) in zip(PROMPTS, answers):
        assert status == 200, doc
        got = np.asarray(doc["logits"], dtype=np.float64)
        want = oracle(prompt)
        assert got.shape == want.shape
        assert np.array_equal(got, got.astype(np.float32).astype(np.float64))   # float32 values, exact through JSON
        if config["max_batch_size"] == 1:   # the oracle's forward exactly: one prompt, one thread
            assert np.array_equal(got.astype(np.float32), want), prompt
        else:
            # Batched prompts run as a GEMM of more rows on more threads, which BLAS may block
            # differently (seen on CI's CPU: 6e-8 apart): float32 rounding, not a different model.
            scale = np.abs(want).max()
            assert np.abs(got - want).max() <= 1e-5 * scale, prompt
    _, metrics, _ = call(static_url + "/metrics", method="GET")
    if config["max_batch_size"] > 1:
        assert metrics["batches"] < metrics["requests"]["ok"]   # requests did share batches


def test_quantization_is_visible(exported, oracle):
    """The file's codes are what is served: the unquantized model it came from answers otherwise."""
    plain = __import__("qcoll.bench.hf_decoder", fromlist=["build_decoder"]).build_decoder(MODEL_ARGS, POSITIONS).eval()
    with torch.no_grad():
        exact = plain(torch.tensor([PROMPTS[0]])).logits[0, -1].numpy()
    assert np.abs(exact - oracle(PROMPTS[0])).max() > 1e-4


def test_generate_is_greedy_on_the_exported_model(static_url, oracle):
    answers = _concurrently(static_url + "/v1/generate", [{"prompt": p, "max_new_tokens": 5} for p in PROMPTS[:6]])
    for prompt, (status, doc, _) in zip(PROMPTS, answers):
        assert status == 200, doc
        seq, want = list(prompt), []
        for _ in range(5):
            token = int(np.argmax(oracle(seq)))
            seq.append(token)
            want.append(token)
        assert doc["tokens"] == want


BAD = [
    (b"{not json", 400, "not JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"prompt": []}, 422, "empty"),
    ({}, 422, "missing field 'prompt'"),
    ({"prompt": "hello"}, 422, "list of token ids"),
    ({"prompt": [1, "2"]}, 422, "'prompt'[1]"),
    ({"prompt": [1, 2.5]}, 422, "'prompt'[1]"),
    ({"prompt": [True]}, 422, "'prompt'[0]"),
    ({"prompt": [256]}, 422, "not a token id"),
    ({"prompt": [-1]}, 422, "not a token id"),
    ({"prompt": [3] * (POSITIONS + 1)}, 422, f"at most {POSITIONS} positions"),
    ({"prompt": [3], "temperature": 1.0}, 422, "unknown field"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_requests_get_a_4xx_naming_the_problem_and_the_server_goes_on(static_url, oracle, body, status, message):
    kw = {"raw": body} if isinstance(body, bytes) else {"body": body}
    got, doc, _ = call(static_url + "/v1/logits", **kw)
    assert got == status and message in doc["error"], (got, doc)
    ok, doc, _ = call(static_url + "/v1/logits", {"prompt": [3, 4]})
    assert ok == 200 and np.array_equal(np.float32(doc["logits"]), oracle([3, 4]))


@pytest.mark.parametrize("body,message", [({"prompt": [3], "max_new_tokens": 0}, "max_new_tokens"),
                                          ({"prompt": [3], "max_new_tokens": "2"}, "max_new_tokens"),
                                          ({"prompt": [3] * 40, "max_new_tokens": 20}, "max_new_tokens is 20")])
def test_bad_generate_requests(static_url, body, message):
    status, doc, _ = call(static_url + "/v1/generate", body)
    assert status == 422 and message in doc["error"]


def test_admin_config_checks_its_values(static_url):
    for body, message in [({"max_batch_size": 0}, "max_batch_size"), ({"workers": "2"}, "workers"),
                          ({"batch_wait_timeout_s": -1}, "batch_wait_timeout_s"), ({"batch": 2}, "unknown field")]:
        status, doc, _ = call(static_url + "/admin/config", body, method="PUT")
        assert status == 422 and message in doc["error"], (body, doc)


class _Slow(TorchRunner):
    """The real model, each forward made 0.2 s longer."""

    def _forward(self, ids):
        time.sleep(0.2)
        return super()._forward(ids)


def test_overload_sheds_with_503_instead_of_queueing_without_bound(exported):
    base = load_runner(*exported)
    runner = _Slow(base.model, base.vocab_size, base.max_positions)
    server = Server(runner, BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1),
                    max_queue=3)
    with serving(build_app(server)) as url:
        t0 = time.monotonic()
        answers = _concurrently(url + "/v1/logits", [{"prompt": [3, 4]}] * 16)
        took = time.monotonic() - t0
        codes = sorted(s for s, _, _ in answers)
        shed = [(d, h) for s, d, h in answers if s == 503]
        assert set(codes) == {200, 503}, codes
        # at most the running request plus max_queue are accepted at once; the rest are refused at once
        assert codes.count(200) <= 8 and len(shed) >= 8, codes
        assert all("overloaded" in d["error"] and h.get("Retry-After") == "1" for d, h in shed)
        assert took < 0.2 * codes.count(200) + 5
        status, doc, _ = call(url + "/v1/logits", {"prompt": [3, 4]})    # and it serves afterwards
        assert status == 200
        _, metrics, _ = call(url + "/metrics", method="GET")
        assert metrics["requests"]["http_503"] == len(shed) and metrics["queued"] == 0


def test_a_tuned_server_refuses_manual_config_and_reports_its_scheduler(exported):
    server = Server(load_runner(*exported), scheduler=SloScheduler(0.1, "rrl"), admin=True)
    with serving(build_app(server)) as url:
        status, doc, _ = call(url + "/admin/config", {"max_batch_size": 4}, method="PUT")
        assert status == 409 and "tuner" in doc["error"]
        assert call(url + "/v1/logits", {"prompt": [5]})[0] == 200
        _, metrics, _ = call(url + "/metrics", method="GET")
        assert metrics["scheduler"]["phase"] == "explore" and metrics["slo_ms"] == 100.0
        assert metrics["requests"]["ok"] == 1 and metrics["p95_ms"] > 0


def test_cli_refuses_what_it_cannot_serve(exported, tmp_path, capsys):
    from qcoll.serve import cli

    path, config = exported
    cases = [([path], "holds no architecture"), ([str(tmp_path / "missing.safetensors")], "no such file"),
             ([path, "--config", str(tmp_path / "nope.json")], "no such file or folder"),
             ([config, "--config", config], "expected a .safetensors file")]
    for argv, message in cases:
        assert cli.main(argv) == 2
        assert message in capsys.readouterr().err, argv


def test_an_onnx_export_is_served_through_onnxruntime(exported, oracle, tmp_path):
    """The same model exported to ONNX (codes in DequantizeLinear nodes, dynamic batch and sequence
    axes) and served by OnnxRunner: onnxruntime's kernels sum in another order than torch's, so the
    logits agree to 1e-5 (test_weights_onnx measures 3e-7), far below the quantization's effect."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    import warnings

    from qcoll.serve import OnnxRunner
    from qcoll.weights import read
    from qcoll.weights.onnx import export_onnx

    path, config = exported
    cfg = transformers.AutoConfig.from_pretrained(config)
    cfg.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    load_quantized(path, model).eval()
    weights, plain, _, _ = read(path)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    dims = {"input_ids": {0: torch.export.Dim("batch", max=64), 1: torch.export.Dim("seq", max=POSITIONS)}}
    onnx_path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_onnx(model, (torch.tensor([[3, 4, 5, 6]] * 2),), weights, onnx_path,
                    plain={k: v for k, v in plain.items() if k in names}, input_names=["input_ids"],
                    output_names=["logits"], dynamic_shapes=dims)
    runner = load_runner(str(onnx_path))
    assert isinstance(runner, OnnxRunner) and runner.vocab_size == MODEL_ARGS.vocab
    with serving(build_app(Server(runner, BatchConfig(max_batch_size=4, batch_wait_timeout_s=0.02,
                                                      intra_op_threads=2)))) as url:
        answers = _concurrently(url + "/v1/logits", [{"prompt": p} for p in PROMPTS[:7]])
    for prompt, (status, doc, _) in zip(PROMPTS, answers):
        assert status == 200, doc
        assert np.abs(np.float32(doc["logits"]) - oracle(prompt)).max() <= 1e-5, prompt
