"""``PUT /admin/config``: who may call it, and the values it accepts.

- Off unless the server was started with it (``Server(admin=True)``, ``qcoll-serve --admin``): 404
  with a message saying so.
- With a token (``Server(admin_token=)``, ``qcoll-serve --admin-token`` or the environment
  variable ``QCOLL_SERVE_ADMIN_TOKEN``) a call must send ``Authorization: Bearer <token>``
  (compared in constant time, ``hmac.compare_digest``); 401 otherwise. ``qcoll-serve`` refuses
  to start with ``--admin`` on an address beyond loopback without a token (:func:`is_loopback`).
- Every field is bounded by the machine and the server (:func:`config_bounds`), 422 naming the
  field and the bound otherwise: ``intra_op_threads`` and ``workers`` at most the machine's cores
  (``os.cpu_count()``; ``workers`` also at most ``MAX_WORKERS``, the batcher's thread pool),
  ``max_batch_size`` at most the server's ``max_queue`` (a batch holds queued requests: a larger
  one never fills and only waits), ``batch_wait_timeout_s`` at most ``MAX_BATCH_WAIT_S`` (the
  tuner's largest is 50 ms: a longer wait holds every request that long).
"""
from __future__ import annotations

import hmac
import ipaddress
import os

from ..checks import check_int, check_number
from .batcher import MAX_WORKERS, BatchConfig
from .body import BadRequest

#: the longest ``batch_wait_timeout_s`` the admin route accepts (20 times the tuner's longest)
MAX_BATCH_WAIT_S = 1.0
#: the environment variable ``qcoll-serve`` reads the admin token from (when ``--admin-token`` is not given)
TOKEN_ENV = "QCOLL_SERVE_ADMIN_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine alone (``localhost``, ``127.0.0.0/8``, ``::1``);
    ``0.0.0.0``, ``::`` and every other name or address reach beyond it."""
    if host.strip().lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(authorization: str | None, token: str | None) -> None:
    """BadRequest(401) unless ``authorization`` is ``Bearer <token>`` (nothing is needed without a token)."""
    if token is None:
        return
    scheme, _, sent = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not sent:
        raise BadRequest(401, "this server's admin API needs 'Authorization: Bearer <token>' (the token qcoll-serve "
                              f"was given with --admin-token or {TOKEN_ENV})")
    if not hmac.compare_digest(sent.strip().encode("utf-8", "surrogateescape"), token.encode("utf-8")):
        raise BadRequest(401, "wrong admin token")


def config_bounds(max_queue: int, cores: int | None = None) -> dict[str, tuple]:
    """Each knob's ``(lowest, highest, why the highest)`` on this machine and server."""
    cores = cores or os.cpu_count() or 1
    return {"max_batch_size": (1, max_queue, f"the server's max_queue, {max_queue}"),
            "batch_wait_timeout_s": (0.0, MAX_BATCH_WAIT_S, f"{MAX_BATCH_WAIT_S:g} s"),
            "workers": (1, min(cores, MAX_WORKERS), f"this machine's {cores} cores" if cores <= MAX_WORKERS
                        else f"the batcher's {MAX_WORKERS} threads"),
            "intra_op_threads": (1, cores, f"this machine's {cores} cores")}


def updated_config(doc, current: BatchConfig, max_queue: int, cores: int | None = None) -> BatchConfig:
    """``current`` with the fields of the request's JSON ``doc`` changed; BadRequest naming the field
    and its bound for anything unknown, of the wrong type or out of bounds."""
    if not isinstance(doc, dict):
        raise BadRequest(400, f"the body must be a JSON object, got {type(doc).__name__}")
    bounds = config_bounds(max_queue, cores)
    unknown = sorted(set(doc) - set(bounds))
    if unknown:
        raise BadRequest(422, f"unknown field(s) {unknown}; this endpoint takes {sorted(bounds)}")
    for name, value in doc.items():
        low, high, why = bounds[name]
        check = check_number if name == "batch_wait_timeout_s" else check_int
        try:
            check(value, f"'{name}'", minimum=low, maximum=high)
        except ValueError as e:
            raise BadRequest(422, f"{e} (at most {why})") from None
    return BatchConfig(**{**current.__dict__, **doc})


__all__ = ["MAX_BATCH_WAIT_S", "TOKEN_ENV", "is_loopback", "check_token", "config_bounds", "updated_config"]
