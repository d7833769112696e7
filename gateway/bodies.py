"""Reading a request body: bounded in size (413) and in time (408), parsed as JSON (400): UTF-8,
without NaN or Infinity (not JSON, though Python's parser takes them) and without a lone UTF-16
surrogate in any string (JSON's escapes can write one; no text can hold it), each refusal naming
what was wrong and, where it can, the field."""

from __future__ import annotations

import json
import math
import re

import anyio
from starlette.requests import ClientDisconnect, Request

from gateway.errors import ApiError, bad_request

CLIENT_GONE = 499   # nginx's number for a client that closed its request; nobody reads the answer

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SEND = "send one JSON object in UTF-8 (Content-Type: application/json)"


async def read_json(request: Request, max_bytes: int, timeout_s: float) -> object:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise _too_large(int(length), max_bytes)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(size, max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g}s") from None
    except ClientDisconnect:
        raise ApiError(CLIENT_GONE, "the client closed the request") from None
    return parse_json(b"".join(chunks))


def parse_json(body: bytes) -> object:
    if not body.strip():
        raise bad_request(f"the request body is empty: {_SEND}")
    try:
        text = body.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 (byte {body[exc.start]:#04x} at {exc.start}): {_SEND}") \
            from None
    try:
        parsed = json.loads(text, parse_constant=_not_a_number, parse_float=_finite)
    except RecursionError:
        raise bad_request(f"the request body is not valid JSON: nested too deeply; {_SEND}") from None
    except ValueError as exc:
        reason = "a number has too many digits" if str(exc).startswith("Exceeds the limit") else str(exc)[:200]
        raise bad_request(f"the request body is not valid JSON: {reason}; {_SEND}") from None
    if _SURROGATE_ESCAPE.search(text):   # rare: only then is every string looked at
        where = _lone_surrogate(parsed)
        if where is not None:
            raise bad_request(f"{where or 'a key'}: has a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
                              f"pair), which is no character: send valid Unicode text", param=where or None)
    return parsed


def _not_a_number(constant: str):
    raise ValueError(f"{constant} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"the number {text[:40]} is beyond a double's range")
    return number


def _lone_surrogate(value: object) -> str | None:
    """The dotted path of the first string (or key: then "") holding a lone surrogate, else None."""
    pending: list[tuple[str, object]] = [("", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            if not all(_encodable(key) for key in item):
                return ""
            pending.extend(reversed([(f"{path}.{key}" if path else key, child) for key, child in item.items()]))
        elif isinstance(item, list):
            pending.extend(reversed([(f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item)]))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more; this gateway takes at most {max_bytes}")
