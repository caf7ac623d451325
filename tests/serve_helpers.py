"""What the serving tests share: a tiny exported model, the server in a thread, JSON over HTTP."""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import select
import socket
import threading
import time
import urllib.error
import urllib.request

MODEL_ARGS = argparse.Namespace(arch="gpt2", layers=2, d_model=64, heads=2, vocab=256, seed=0)
POSITIONS = 48


@contextlib.contextmanager
def serving(app):
    """``app`` under uvicorn on 127.0.0.1 (an ephemeral port) in a thread; yields the base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"


def call(url: str, body=None, method: str = "POST", raw: bytes | None = None, timeout: float = 30,
         headers: dict | None = None):
    """``(status, JSON answer, headers)`` (headers case-insensitive); ``body`` is sent as JSON, ``raw`` as it is."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method if data is not None or method != "POST" else "GET",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as e:
        text = e.read() or b"null"
        try:
            return e.code, json.loads(text), e.headers
        except ValueError:      # not JSON (a server error page): as text
            return e.code, {"error": text.decode(errors="replace")}, e.headers


def send_body(port: int, path: str, total: int, *, chunked: bool = False, declared: int | None = None,
              chunk: int = 64 << 10, method: str = "POST", limit_s: float = 30.0) -> tuple:
    """A request with a ``total``-byte body sent ``chunk`` bytes at a time (``Transfer-Encoding:
    chunked``, or ``Content-Length: declared`` (default ``total``)), stopping as soon as the server
    answers. ``(status or None, JSON answer or None, body bytes handed to the socket)``."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {total if declared is None else declared}"
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"{framing}\r\n\r\n".encode())
        s.setblocking(False)
        sent, pending, ended, data = 0, b"", not chunked, b" " * chunk
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            more = sent < total or pending or not ended
            readable, writable, _ = select.select([s], [s] if more else [], [], 0.5)
            if readable:
                break
            if not writable:
                continue
            if not pending:
                n = min(chunk, total - sent)
                if n == 0:
                    pending, ended = b"0\r\n\r\n", True
                else:
                    pending = (f"{n:x}\r\n".encode() + data[:n] + b"\r\n") if chunked else data[:n]
                    sent += n
            try:
                pending = pending[s.send(pending):]
            except (BrokenPipeError, ConnectionResetError):
                break
        s.setblocking(True)
        s.settimeout(max(0.1, deadline - time.monotonic()))
        return (*_read_response(s), sent)


def _read_response(s: socket.socket) -> tuple:
    """``(status, JSON body)`` of the response on ``s``; ``(None, None)`` when none came."""
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            if not got:
                return None, None
            buf += got
        head, _, body = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        while length and len(body) < int(length.group(1)):
            got = s.recv(65536)
            if not got:
                break
            body += got
    except (OSError, ValueError, IndexError):
        return None, None
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, None


def hang_up(port: int, path: str, method: str = "POST", declared: int = 1000, send: int = 100) -> None:
    """A request that announces a ``declared``-byte body, sends ``send`` bytes of it and hangs up."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {declared}\r\n\r\n".encode() + b" " * send)
        time.sleep(0.05)    # the server has the headers and waits for the rest


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s*(\d+) kB", f.read()).group(1)) * 1024


@contextlib.contextmanager
def rss_peak(pid: int, every_s: float = 0.005):
    """Samples ``pid``'s RSS in a thread while the block runs; yields a dict whose ``"growth"``
    (the peak over the RSS before the block, in bytes) is set when the block ends."""
    out = {"before": rss_bytes(pid), "peak": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            out["peak"] = max(out["peak"], rss_bytes(pid))
            stop.wait(every_s)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join(5)
        out["peak"] = max(out["peak"], rss_bytes(pid))
        out["growth"] = out["peak"] - out["before"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, limit_s: float = 30.0, every_s: float = 0.05):
    """``predicate()``'s first truthy value, polled until ``limit_s`` has passed (then its last value)."""
    deadline = time.monotonic() + limit_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


class TinyRunner:
    """A model-less runner (``qcoll.serve.Runner``'s interface): zero logits, for the routes alone."""

    vocab_size, max_positions = 16, 32

    def set_threads(self, intra_op: int) -> None:
        self.threads = intra_op

    def logits(self, prompts):
        import numpy as np
        return [np.zeros(self.vocab_size, np.float32) for _ in prompts]

    def generate(self, prompts, max_new_tokens):
        return [[0] * n for n in max_new_tokens]

