"""The HTTP API (a Starlette ASGI app, served by uvicorn): validation, the batcher, the scheduler.

Endpoints (JSON in and out):

- ``POST /v1/logits`` ``{"prompt": [token ids]}`` -> ``{"logits": [vocab_size floats]}``: the
  next-token logits (float32 values, exact through JSON).
- ``POST /v1/generate`` ``{"prompt": [token ids], "max_new_tokens": n}`` -> ``{"tokens": [...]}``:
  greedy continuation (``n`` from 1 to ``MAX_NEW_TOKENS``, default 16).
- ``GET /health`` -> ``{"status": "ok"}``; ``GET /metrics``: request counts, latency percentiles
  (p50/p95/p99 over the last ``RECENT`` requests), the SLO and its violations, the running
  configuration (``config``, its label; ``config_body``, its fields: the JSON body ``PUT
  /admin/config`` takes as is) and the scheduler's state.
- ``PUT /admin/config`` ``{"max_batch_size", "batch_wait_timeout_s", "workers",
  "intra_op_threads"}`` (any of them): set the batching knobs of a server without a tuner (409
  while a tuner sets them), as Ray Serve's ``set_max_batch_size`` does. Off (404) unless the
  server was made with ``admin=True`` (``qcoll-serve --admin``); with ``admin_token`` it needs
  ``Authorization: Bearer <token>`` (401); every field bounded by the machine (:mod:`.admin`).

Bad requests get 400 (not JSON, nested deeper than ``MAX_JSON_DEPTH``, not an object), 413 (a
body over ``max_body`` bytes: refused from its ``Content-Length`` before it is read, or as soon as
a chunked body passes it; :mod:`.body`) or 422 (a field missing, of the wrong type or out of
range, or unknown), with a message naming the field; a full queue gets 503 with
``Retry-After``. The server keeps serving after any of them. A client that hangs up before its
body is read is counted (``client_disconnects`` in ``/metrics``) and logged in one line at most
once a minute (logger ``qcoll.serve``), never as a traceback.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..checks import check_bool, check_int
from . import admin
from .batcher import Batcher, BatchConfig, Overloaded
from .body import MAX_BODY, BadRequest, ClientGone, checked_field, parse_json, read_body, short_repr
from .runner import Runner
from .scheduler import SloScheduler

MAX_NEW_TOKENS = 64
RECENT = 10_000
#: seconds between two log lines about clients that hung up (each one is counted in /metrics)
DISCONNECT_LOG_EVERY_S = 60.0
log = logging.getLogger("qcoll.serve")


def parse_request(body: bytes, runner: Runner, generate: bool) -> tuple:
    """The batcher's payload ``(kind, prompt, max_new_tokens)`` of a request body, or BadRequest."""
    doc = parse_json(body)
    if not isinstance(doc, dict):
        raise BadRequest(400, f"the body must be a JSON object, got {type(doc).__name__}")
    allowed = {"prompt", "max_new_tokens"} if generate else {"prompt"}
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise BadRequest(422, f"unknown field(s) {unknown}; this endpoint takes {sorted(allowed)}")
    if "prompt" not in doc:
        raise BadRequest(422, "missing field 'prompt' (a list of token ids)")
    prompt = doc["prompt"]
    if not isinstance(prompt, list):
        raise BadRequest(422, f"'prompt' must be a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise BadRequest(422, "'prompt' is empty: give at least one token id")
    n = 0
    if generate:
        n = doc.get("max_new_tokens", 16)
        checked_field(check_int, n, "'max_new_tokens'", minimum=1, maximum=MAX_NEW_TOKENS)
    if len(prompt) + n > runner.max_positions:
        raise BadRequest(422, f"'prompt' has {len(prompt)} tokens" + (f" and max_new_tokens is {n}" if n else "") +
                         f": the model takes at most {runner.max_positions} positions")
    for i, t in enumerate(prompt):
        checked_field(check_int, t, f"'prompt'[{i}] (a token id)")
        if not 0 <= t < runner.vocab_size:
            raise BadRequest(422, f"'prompt'[{i}] = {short_repr(t)} is not a token id of this model (0 to "
                                  f"{runner.vocab_size - 1})")
    return ("generate" if generate else "logits", prompt, n)


def run_batch(runner: Runner, payloads: list[tuple]) -> list:
    """A batch of mixed payloads: the logits requests as one call, the generate requests as another."""
    out: list = [None] * len(payloads)
    for kind in ("logits", "generate"):
        idx = [i for i, p in enumerate(payloads) if p[0] == kind]
        if not idx:
            continue
        if kind == "logits":
            got = runner.logits([payloads[i][1] for i in idx])
        else:
            got = runner.generate([payloads[i][1] for i in idx], [payloads[i][2] for i in idx])
        for i, r in zip(idx, got):
            out[i] = r
    return out


class Server:
    """The state behind the app: runner, batcher, scheduler (None: static configuration), statistics.

    ``max_body``: the largest request body in bytes (413 above it); ``admin``: whether
    ``PUT /admin/config`` is on; ``admin_token``: the bearer token it then needs (None: none)."""

    def __init__(self, runner: Runner, config: BatchConfig | None = None, scheduler: SloScheduler | None = None,
                 max_queue: int = 256, slo_s: float | None = None, max_body: int = MAX_BODY, admin: bool = False,
                 admin_token: str | None = None):
        self.runner, self.scheduler = runner, scheduler
        config = scheduler.config if scheduler is not None else (config or BatchConfig())
        self.slo_s = scheduler.slo_s if scheduler is not None else slo_s
        self.batcher = Batcher(lambda p: run_batch(runner, p), config, max_queue=max_queue,
                               set_threads=runner.set_threads)
        self.max_body = check_int(max_body, "max_body", minimum=1)
        self.admin = check_bool(admin, "admin")
        if admin_token is not None and (not isinstance(admin_token, str) or not admin_token.strip()):
            raise ValueError("admin_token must be a non-empty string or None")
        self.admin_token = admin_token.strip() if admin_token is not None else None
        self.latencies: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.counts = collections.Counter()
        self.client_disconnects = 0
        self._disconnects_logged, self._disconnect_logged_at = 0, None

    async def _body(self, request: Request) -> bytes:
        """The request's body, read under ``max_body``; BadRequest, or ClientGone (counted)."""
        try:
            return await read_body(request, self.max_body)
        except ClientGone as e:
            self._client_gone(str(e))
            raise

    def _client_gone(self, what: str) -> None:
        """Count a client that hung up; a log line for the first, then at most one a minute."""
        self.client_disconnects += 1
        now = time.monotonic()
        if self._disconnect_logged_at is None or now - self._disconnect_logged_at >= DISCONNECT_LOG_EVERY_S:
            new = self.client_disconnects - self._disconnects_logged
            log.warning("%s (%d client(s) hung up since the last such line, %d in all: /metrics client_disconnects; "
                        "at most one line every %g s)", what, new, self.client_disconnects, DISCONNECT_LOG_EVERY_S)
            self._disconnects_logged, self._disconnect_logged_at = self.client_disconnects, now

    def _refuse(self, e: BadRequest) -> Response:
        self.counts[f"http_{e.status}"] += 1
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse({"error": str(e)}, status_code=e.status, headers=headers)

    async def handle(self, request: Request, generate: bool) -> Response:
        start = time.monotonic()
        try:
            payload = parse_request(await self._body(request), self.runner, generate)
        except BadRequest as e:
            return self._refuse(e)
        except ClientGone:
            return Response(status_code=400)   # nobody reads it
        epoch = self.scheduler.arrived() if self.scheduler is not None else 0
        try:
            future = self.batcher.submit(payload)
        except Overloaded as e:
            self.counts["http_503"] += 1
            self._tell(self.scheduler.shed(epoch) if self.scheduler is not None else None)
            return JSONResponse({"error": f"overloaded: {e}; retry later"}, status_code=503,
                                headers={"Retry-After": "1"})
        try:
            result = await future
        except Overloaded as e:
            self.counts["http_503"] += 1
            return JSONResponse({"error": str(e)}, status_code=503, headers={"Retry-After": "1"})
        except Exception as e:   # the model failed on this batch: the server goes on
            self.counts["http_500"] += 1
            return JSONResponse({"error": f"the model failed: {type(e).__name__}: {e}"}, status_code=500)
        latency = time.monotonic() - start
        self.latencies.append(latency)
        self.counts["ok"] += 1
        if self.slo_s is not None and latency > self.slo_s:
            self.counts["slo_violations"] += 1
        if self.scheduler is not None:
            self._tell(self.scheduler.completed(latency, epoch))
        if generate:
            return JSONResponse({"tokens": result})
        return JSONResponse({"logits": np.asarray(result, dtype=np.float32).tolist()})

    async def set_config(self, request: Request) -> Response:
        """``PUT /admin/config``: off, then the token, then the tuner, then the body (see :mod:`.admin`)."""
        try:
            if not self.admin:
                raise BadRequest(404, "the admin API is off: start qcoll-serve with --admin (Server(admin=True)) to "
                                      "enable PUT /admin/config")
            admin.check_token(request.headers.get("authorization"), self.admin_token)
            if self.scheduler is not None:
                raise BadRequest(409, "a tuner sets the batching knobs of this server (started without --tuner none)")
            config = admin.updated_config(parse_json(await self._body(request)), self.batcher.config,
                                          self.batcher.max_queue)
        except BadRequest as e:
            return self._refuse(e)
        except ClientGone:
            return Response(status_code=400)
        self.batcher.reconfigure(config)
        return JSONResponse({"config": config.label()})

    def _tell(self, config: BatchConfig | None) -> None:
        if config is not None:
            self.batcher.reconfigure(config)

    def metrics(self) -> dict:
        lat = np.asarray(self.latencies, dtype=float)
        pct = {f"p{q}_ms": float(np.percentile(lat, q) * 1e3) if lat.size else None for q in (50, 95, 99)}
        return {"requests": dict(self.counts), "client_disconnects": self.client_disconnects,
                "recent": int(lat.size), **pct,
                "slo_ms": self.slo_s * 1e3 if self.slo_s is not None else None,
                "queued": len(self.batcher.queue), "batches": self.batcher.batches,
                "config": self.batcher.config.label(),
                "config_body": dataclasses.asdict(self.batcher.config),   # PUT /admin/config's body, as is
                "scheduler": self.scheduler.state() if self.scheduler is not None else None,
                "switches": [[t, c] for t, c in self.scheduler.switches] if self.scheduler is not None else []}


def build_app(server: Server) -> Starlette:
    """The ASGI app over ``server`` (the batcher starts and stops with the app's lifespan)."""

    async def logits(request):
        return await server.handle(request, generate=False)

    async def generate(request):
        return await server.handle(request, generate=True)

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def metrics(request):
        return JSONResponse(server.metrics())

    async def admin_config(request):
        return await server.set_config(request)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await server.batcher.start()
        try:
            yield
        finally:
            await server.batcher.stop()

    return Starlette(routes=[Route("/v1/logits", logits, methods=["POST"]),
                             Route("/v1/generate", generate, methods=["POST"]),
                             Route("/health", health), Route("/metrics", metrics),
                             Route("/admin/config", admin_config, methods=["PUT"])], lifespan=lifespan)


__all__ = ["Server", "build_app", "parse_request", "run_batch", "BadRequest"]
