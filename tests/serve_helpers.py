"""What the serving tests share: a tiny exported model, the server in a thread, JSON over HTTP."""
from __future__ import annotations

import argparse
import contextlib
import json
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


def call(url: str, body=None, method: str = "POST", raw: bytes | None = None, timeout: float = 30):
    """``(status, JSON answer, headers)`` (headers case-insensitive); ``body`` is sent as JSON, ``raw`` as it is."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method if data is not None or method != "POST" else "GET",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read()), resp.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null"), e.headers
