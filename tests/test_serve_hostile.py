"""qcoll-serve against careless and hostile clients and files (issue 39, items 7-12), all on 127.0.0.1.

One ``qcoll-serve`` process serves the module's HTTP tests (its RSS read from /proc, its stderr
from a file): start-up stages, bodies over the limit (Content-Length and chunked), deeply nested
JSON, clients that hang up mid-body. The admin route runs in-thread on a model-less runner; the
hostile model files are loaded in-process. Every client loop is bounded in bytes and seconds.
"""
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("transformers")

from qcoll.bench.serve_model import write_model  # noqa: E402
from qcoll.serve import BatchConfig, Server, build_app, load_runner  # noqa: E402
from qcoll.serve import cli  # noqa: E402
from qcoll.serve.admin import TOKEN_ENV, is_loopback  # noqa: E402

from serve_helpers import (MODEL_ARGS, POSITIONS, TinyRunner, call, free_port, hang_up, rss_peak,  # noqa: E402
                           send_body, serving, wait_for)

LIMIT = 1 << 20            # the served process's --max-body
SENT = 50 << 20            # what a hostile client offers
GROWTH = 24 << 20          # the most the server's RSS may grow while it refuses SENT bytes
STAGES = ["loading the model:", "model loaded in", "warm-up:", "listening on http://127.0.0.1:"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("hostile-model")), MODEL_ARGS, POSITIONS)


class Served:
    """The qcoll-serve process: ``proc``, ``port``, ``url``, ``log`` (its stderr), and what start-up showed."""

    def __init__(self, proc, port, log):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.lines: list[str] = []           # stderr when it said it listens (or when /health first answered)
        self.health_after_line = None        # (status, seconds) of /health asked right after the line

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    path, config = model
    folder = tmp_path_factory.mktemp("hostile-served")
    port, log = free_port(), folder / "stderr.txt"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "qcoll.serve.cli", path, "--config", config, "--port", str(port),
                                 "--tuner", "none", "--admin", "--max-body", str(LIMIT), "--max-batch-size", "1",
                                 "--batch-wait-ms", "0", "--workers", "1", "--intra-op-threads", "1"],
                                stdout=subprocess.DEVNULL, stderr=err, cwd=folder)
    s = Served(proc, port, log)
    try:
        deadline, tries = time.monotonic() + 180, 0
        while True:
            text = s.stderr()
            assert proc.poll() is None, f"qcoll-serve exited with {proc.returncode}:\n{text}"
            assert time.monotonic() < deadline, f"qcoll-serve did not start within 180 s:\n{text}"
            if "listening on" in text:
                t0 = time.monotonic()
                status = call(s.url + "/health", method="GET", timeout=10)[0]
                s.lines, s.health_after_line = text.splitlines(), (status, time.monotonic() - t0)
                break
            tries += 1
            if tries % 10 == 0:    # without a listening line, /health tells when it serves
                with contextlib.suppress(OSError):
                    if call(s.url + "/health", method="GET", timeout=0.5)[0] == 200:
                        s.lines = s.stderr().splitlines()
                        break
            time.sleep(0.05)
        yield s
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metrics(served) -> dict:
    return call(served.url + "/metrics", method="GET", timeout=10)[1]


# ------------------------------------------------------------------------- 12: start-up
def test_startup_prints_its_stages_in_order_and_health_answers_once_listening(served, model):
    where = [next((i for i, line in enumerate(served.lines) if stage in line), None) for stage in STAGES]
    assert None not in where, f"stages {STAGES} not all on stderr:\n" + "\n".join(served.lines)
    assert where == sorted(where), "\n".join(served.lines)
    loading, listening = served.lines[where[0]], served.lines[where[-1]]
    assert "model.safetensors" in loading and f"{os.path.getsize(model[0]):,} bytes" in loading, loading
    assert f"http://127.0.0.1:{served.port}" in listening
    status, took = served.health_after_line
    assert status == 200 and took < 2.0, served.health_after_line


# ------------------------------------------------------------------------- 7: body limit
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_refused_while_it_streams(served, chunked):
    """A true Content-Length over the limit is refused before the body is read; a chunked body as
    soon as ~limit bytes came. Either way the server's RSS grows far less than what was offered."""
    with rss_peak(served.proc.pid) as rss:
        status, doc, sent = send_body(served.port, "/v1/logits", SENT, chunked=chunked)
    assert status == 413 and str(LIMIT) in doc["error"], (status, doc)
    assert sent < SENT // 3, f"the client got to send {sent} bytes before the answer"
    assert rss["growth"] < GROWTH, f"the server's RSS grew by {rss['growth'] / 2**20:.1f} MiB"
    assert call(served.url + "/v1/logits", {"prompt": [3, 4]}, timeout=30)[0] == 200


@pytest.mark.parametrize("path,method", [("/v1/logits", "POST"), ("/v1/generate", "POST"),
                                         ("/admin/config", "PUT")])
def test_every_route_answers_413_from_the_content_length_alone(served, path, method):
    """The headers announce SENT bytes and none follow: the answer comes without waiting for them."""
    t0 = time.monotonic()
    status, doc, _ = send_body(served.port, path, 0, declared=SENT, method=method, limit_s=5)
    assert status == 413 and "Content-Length" in doc["error"], (path, status, doc)
    assert time.monotonic() - t0 < 3


# ------------------------------------------------------------------------- 9: nesting
@pytest.mark.parametrize("path,method", [("/v1/logits", "POST"), ("/v1/generate", "POST"),
                                         ("/admin/config", "PUT")])
def test_deeply_nested_json_is_a_400_naming_the_depth(served, path, method):
    for body in ["[" * 100_000 + "]" * 100_000, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"]:
        status, doc, _ = call(served.url + path, raw=body.encode(), method=method, timeout=30)
        assert status == 400 and re.search(r"nests JSON arrays and objects 10000[01] deep", doc["error"]), \
            (path, status, doc)
    assert call(served.url + "/v1/logits", {"prompt": [3]}, timeout=30)[0] == 200


# ------------------------------------------------------------------------- 10: hang-ups
def test_clients_that_hang_up_mid_body_are_counted_and_logged_in_a_line_not_a_traceback(served):
    n, before, log_before = 6, _metrics(served)["client_disconnects"], len(served.stderr())
    for i in range(n):
        hang_up(served.port, *[("/v1/logits", "POST"), ("/v1/generate", "POST"), ("/admin/config", "PUT")][i % 3])
    got = wait_for(lambda: _metrics(served)["client_disconnects"] - before >= n, limit_s=10)
    assert got, _metrics(served)
    assert _metrics(served)["client_disconnects"] - before == n
    time.sleep(0.2)    # anything the hang-ups logged is written by now
    new = served.stderr()[log_before:]
    assert "Traceback" not in new and "ClientDisconnect" not in new, new
    lines = new.splitlines()
    assert len(lines) <= 1 and all(len(line) < 300 for line in lines), new
    assert call(served.url + "/v1/logits", {"prompt": [3]}, timeout=30)[0] == 200


# ------------------------------------------------------------------------- 8: admin
def _tiny_server(**kw) -> Server:
    config = BatchConfig(max_batch_size=1, batch_wait_timeout_s=0.0, workers=1, intra_op_threads=1)
    return Server(TinyRunner(), config, max_queue=16, **kw)


def test_admin_config_is_off_unless_enabled():
    with serving(build_app(_tiny_server())) as url:
        status, doc, _ = call(url + "/admin/config", {"workers": 1}, method="PUT")
        assert status == 404 and "--admin" in doc["error"], doc
        assert call(url + "/v1/logits", {"prompt": [1]})[0] == 200


def test_admin_config_bounds_every_field_by_the_machine():
    cores = os.cpu_count() or 1
    server = _tiny_server(admin=True)
    bad = [({"workers": 20_000}, "'workers'", f"in [1, {min(cores, 64)}]"),
           ({"intra_op_threads": 256 if cores < 256 else cores + 1}, "'intra_op_threads'", f"in [1, {cores}]"),
           ({"max_batch_size": 10 ** 12}, "'max_batch_size'", "max_queue, 16"),
           ({"batch_wait_timeout_s": 60}, "'batch_wait_timeout_s'", "in [0.0, 1"),
           ({"workers": 0}, "'workers'", "in [1, ")]
    with serving(build_app(server)) as url:
        for body, field, bound in bad:
            status, doc, _ = call(url + "/admin/config", body, method="PUT")
            assert status == 422 and field in doc["error"] and bound in doc["error"], (body, doc)
        assert server.batcher.config.workers == 1 and server.batcher.config.max_batch_size == 1   # none applied
        top = {"workers": min(cores, 64), "intra_op_threads": cores, "max_batch_size": 16, "batch_wait_timeout_s": 1}
        status, doc, _ = call(url + "/admin/config", top, method="PUT")
        assert status == 200, doc
        status, doc, _ = call(url + "/admin/config", {"workers": 1, "batch_wait_timeout_s": 0}, method="PUT")
        assert status == 200 and call(url + "/v1/logits", {"prompt": [1]})[0] == 200


def test_admin_config_needs_the_token_when_one_is_set():
    server = _tiny_server(admin=True, admin_token="s3cret-token")
    with serving(build_app(server)) as url:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"},
                        {"Authorization": "s3cret-token"}]:
            status, doc, got = call(url + "/admin/config", {"max_batch_size": 2}, method="PUT", headers=headers)
            assert status == 401 and got.get("WWW-Authenticate") == "Bearer", (headers, doc)
        assert server.batcher.config.max_batch_size == 1
        status, doc, _ = call(url + "/admin/config", {"max_batch_size": 2}, method="PUT",
                              headers={"Authorization": "Bearer s3cret-token"})
        assert status == 200 and server.batcher.config.max_batch_size == 2


def test_cli_refuses_admin_beyond_loopback_without_a_token(model, monkeypatch, capsys):
    path, config = model
    monkeypatch.delenv(TOKEN_ENV, raising=False)

    def no_server(args):   # what must never be reached here: a model loaded, then served beyond loopback
        raise AssertionError(f"qcoll-serve went on to serve on {args.host}")
    monkeypatch.setattr(cli, "build_server", no_server)
    parser = cli.build_parser()
    for host in ["0.0.0.0", "::", "192.0.2.7", "example.org"]:
        with pytest.raises(SystemExit) as e:
            cli.main([path, "--config", config, "--host", host, "--admin"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"--admin on --host {host}" in err and "--admin-token" in err and "Traceback" not in err, err
    for argv, env in [(["--host", "0.0.0.0", "--admin", "--admin-token", "t0ken"], None),
                      (["--host", "0.0.0.0", "--admin"], "t0ken"), (["--admin"], None), (["--host", "0.0.0.0"], None)]:
        if env:
            monkeypatch.setenv(TOKEN_ENV, env)
        args = parser.parse_args([path, "--config", config, *argv])
        cli.check_args(parser, args)                         # accepted: a token, loopback, or no admin API
        assert args.admin_token == ("t0ken" if args.admin and "0.0.0.0" in argv else None)
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert all(map(is_loopback, ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "localhost.example.org", ""]))
    for option, value in [("--workers", "20000"), ("--intra-op-threads", "100000"), ("--batch-wait-ms", "60000")]:
        with pytest.raises(SystemExit):
            cli.main([path, "--config", config, option, value])
        assert option in capsys.readouterr().err


# ------------------------------------------------------------------------- 11: hostile model files
@contextlib.contextmanager
def address_space_headroom(extra: int):
    """This process may map at most ``extra`` more bytes meanwhile: a model allocated by mistake is a
    MemoryError / RuntimeError here, not the machine's memory exhausted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        mapped = int(re.search(r"VmSize:\s*(\d+) kB", f.read()).group(1)) * 1024
    cap = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _config_with(tmp_path, model, **changes) -> str:
    doc = json.loads(open(model[1]).read())
    doc.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _one_line_exit(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("qcoll-serve: loading the model")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("changes,says", [(dict(n_layer=86, n_embd=12288, n_head=96), "asks for 86 layers"),
                                          (dict(n_layer=2, n_embd=16384, n_head=2), "describes a model of")],
                         ids=["155G-parameters", "wide-layers"])
def test_a_config_larger_than_the_weights_file_is_refused_before_allocating(model, tmp_path, capsys, changes, says):
    config = _config_with(tmp_path, model, **changes)
    size = os.path.getsize(model[0])
    with address_space_headroom(2 << 30):
        with pytest.raises(ValueError) as e:
            load_runner(model[0], config)
        line = _one_line_exit([model[0], "--config", config], capsys)
    message = str(e.value)
    assert config in message and model[0] in message and says in message and f"{size:,} bytes" in message, message
    assert config in line


def test_any_load_failure_ends_qcoll_serve_in_one_line(model, monkeypatch, capsys):
    def fails(*args):
        raise RuntimeError("something unforeseen\n  with a second line")
    monkeypatch.setattr(cli, "load_runner", fails)
    line = _one_line_exit([model[0], "--config", model[1]], capsys)
    assert "RuntimeError: something unforeseen" in line and model[0] in line, line


def test_a_config_of_another_smaller_model_is_a_one_line_error(model, tmp_path, capsys):
    config = _config_with(tmp_path, model, n_layer=1)
    with pytest.raises(ValueError, match="does not hold the model of config"):
        load_runner(model[0], config)
    assert "does not hold the model" in _one_line_exit([model[0], "--config", config], capsys)


def test_a_deeply_nested_config_and_a_garbage_onnx_file_are_one_line_errors(model, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match="nests JSON arrays and objects 100001 deep") as e:
        load_runner(model[0], str(config))
    assert str(config) in str(e.value)
    assert "100001 deep" in _one_line_exit([model[0], "--config", str(config)], capsys)
    pytest.importorskip("onnxruntime")
    garbage = tmp_path / "model.onnx"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="not an ONNX model onnxruntime can load") as e:
        load_runner(str(garbage))
    assert str(garbage) in str(e.value)
    assert str(garbage) in _one_line_exit([str(garbage)], capsys)


def test_a_model_file_that_is_not_a_regular_file_says_what_it_is(model, tmp_path, capsys):
    zero = tmp_path / "zero.safetensors"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.onnx"
    folder.mkdir()
    for path, kind in [(zero, "a character device"), (fifo, "a FIFO"), (folder, "a folder")]:
        with pytest.raises(ValueError, match="not a regular file") as e:
            load_runner(str(path), model[1] if path.suffix == ".safetensors" else None)
        assert kind in str(e.value) and str(path) in str(e.value), e.value
    assert "/dev/zero" in _one_line_exit([str(zero), "--config", model[1]], capsys)
    # a config that is a FIFO is refused too, never opened (opening it would wait for a writer)
    config = tmp_path / "config.json"
    os.mkfifo(config)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_raises(load_runner, model[0], str(config))), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():    # it opened the FIFO: let it go
        os.close(os.open(config, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
    assert outcome and "a FIFO" in outcome[0] and "not a regular file" in outcome[0], outcome


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
