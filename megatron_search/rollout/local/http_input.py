"""Reading and checking request bodies on the local engine server (and its chat endpoint).

Bad input is answered with a 4xx that names the field and changes nothing: `read_json` reads at
most the route's byte limit (413 beyond it, before parsing), refuses bodies that are not a UTF-8
JSON object (NaN and Infinity included: they are not JSON), and the `field` helpers check types
(bool is not an int, an int is a float, lists element by element).
"""
from __future__ import annotations

import json
import math
from typing import Any, Optional

from aiohttp import web

BODY_LIMITS = web.AppKey("body_limits", dict)  # {"default": bytes, path: bytes}; local_server.body_limits


class BadRequest(ValueError):
    """The request body is wrong; the message names the field. `status` is the HTTP answer (400 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _refuse_constant(name: str):
    raise BadRequest(f"{name} is not JSON (numbers must be finite)")


def body_limit(request: web.Request) -> int:
    limits = request.app.get(BODY_LIMITS) or {}
    return int(limits.get(request.path, limits.get("default", 1 << 26)))


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object ({} when there is none), read up to the route's limit."""
    limit = body_limit(request)
    where = request.path
    if request.content_length is not None and request.content_length > limit:
        raise BadRequest(f"{where}: request body of {request.content_length} bytes exceeds the limit of {limit} "
                         "bytes (rollout.local.max_request_mb)", 413)
    if not request.can_read_body:
        return {}
    chunks, size = [], 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"{where}: request body exceeds the limit of {limit} bytes (rollout.local.max_request_mb)",
                             413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as e:
        raise BadRequest(f"{where}: body is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise BadRequest(f"{where}: body is not valid JSON ({e.msg} at {e.pos})") from None
    except BadRequest as e:
        raise BadRequest(f"{where}: body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{where}: body must be a JSON object, got {type(body).__name__}")
    return body


def _kind_name(kind) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(kind, getattr(kind, "__name__", str(kind)))


def check_value(value: Any, kind, name: str, where: str) -> Any:
    """`value` as `kind` (float accepts integers; int and float refuse booleans), else BadRequest."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if not ok:
        raise BadRequest(f"{where}: field {name!r} must be {_kind_name(kind)}, got {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        raise BadRequest(f"{where}: field {name!r} must be finite, got {value}")
    return value


def field(body: dict, name: str, kind, default: Any = ..., where: str = "") -> Any:
    """body[name] checked as `kind`; a missing or null field is `default` (required when not given)."""
    if body.get(name) is None:
        if default is ...:
            raise BadRequest(f"{where}: missing required field {name!r}")
        return default
    return check_value(body[name], kind, name, where)


def list_field(body: dict, name: str, item_kind, default: Any = ..., where: str = "") -> Optional[list]:
    """A list whose every element is `item_kind` (the message names the first bad index)."""
    value = field(body, name, list, default, where)
    if value is None or value is default:
        return value
    return [check_value(v, item_kind, f"{name}[{i}]", where) for i, v in enumerate(value)]


def int_in(value: int, name: str, lo: int, hi: int, where: str) -> int:
    """`value` within [lo, hi], else BadRequest naming the range."""
    if not lo <= value <= hi:
        raise BadRequest(f"{where}: field {name!r} must be in [{lo}, {hi}], got {value}")
    return value
