"""Request bodies read under a size limit, and JSON parsed under a nesting limit.

:func:`read_body` never holds more than the limit (plus one chunk the server received) of a
body: a ``Content-Length`` over the limit is answered 413 before any of the body is read, and a
body without one (chunked) is counted as it streams in and answered 413 as soon as the count
passes the limit; the rest is never read into memory (uvicorn drops what still arrives).

:func:`parse_json` refuses JSON that nests arrays and objects deeper than ``MAX_JSON_DEPTH``
before ``json.loads`` sees it (which recurses once per level: 100,000 levels end in a
RecursionError), found by a scan that does not recurse (:func:`json_depth`).

A client that hangs up while its body is read raises :class:`ClientGone` (the server counts it;
Starlette's ``ClientDisconnect`` would end in a logged traceback).
"""
from __future__ import annotations

import json
import re
from array import array
from itertools import accumulate

from starlette.requests import ClientDisconnect, Request

#: request bodies: 1 MiB by default (``Server(max_body=)``, ``qcoll-serve --max-body``)
MAX_BODY = 1 << 20
#: the deepest nesting of arrays and objects a request's JSON may have (the API's need 2)
MAX_JSON_DEPTH = 32


class BadRequest(ValueError):
    """A request answered with ``status`` (4xx) and ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def checked_field(check, value, name: str, **bounds):
    """``check(value, name, **bounds)`` (:func:`qcoll.checks.check_int` / ``check_number``) on a request
    field: its value, or its error as a 422 naming the field."""
    try:
        return check(value, name, **bounds)
    except ValueError as e:
        raise BadRequest(422, str(e)) from None


class ClientGone(Exception):
    """The client hung up before its body was read whole."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body of ``request``; BadRequest(413) once it is over ``limit`` bytes (at once from a
    ``Content-Length``, else as soon as the bytes read pass it), BadRequest(400) for a malformed
    ``Content-Length``, ClientGone when the client hangs up first."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.strip().isdigit()):
            raise BadRequest(400, f"the Content-Length header is not a byte count: {declared[:40]!r}")
        if int(declared) > limit:
            raise BadRequest(413, f"the body is {int(declared)} bytes (Content-Length), over the limit of {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(413, f"the body is over the limit of {limit} bytes (read {size} so far; stopped)")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client hung up after {size} bytes of its body") from None
    return b"".join(chunks)


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message never echoes a whole body)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


_BRACKETS = str.maketrans("[{]}", "\x01\x01\xff\xff")


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text``, without parsing it or recursing:
    escapes and strings dropped, then the running count of the brackets left (+1 / -1)."""
    text = re.sub(r'"[^"]*+"', "", text.replace("\\\\", "").replace('\\"', ""))
    steps = array("b", re.sub(r"[^\[\]{}]+", "", text).translate(_BRACKETS).encode("latin-1"))
    return max(accumulate(steps), default=0)


def parse_json(body: bytes, max_depth: int = MAX_JSON_DEPTH):
    """The JSON document of ``body`` (UTF-8); BadRequest(400) naming the problem when it is not
    UTF-8, not JSON, or nested deeper than ``max_depth``."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"the body is not JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise BadRequest(400, f"the body nests JSON arrays and objects {depth} deep; at most {max_depth} are "
                              "accepted")
    try:
        return json.loads(text)
    except ValueError as e:
        raise BadRequest(400, f"the body is not JSON: {e}") from None
    except RecursionError:   # json_depth counts what json.loads recurses on; kept so that none ends in a 500
        raise BadRequest(400, f"the body nests JSON too deep to parse (at most {max_depth} levels)") from None


__all__ = ["MAX_BODY", "MAX_JSON_DEPTH", "BadRequest", "ClientGone", "read_body", "json_depth", "parse_json", "short_repr"]
