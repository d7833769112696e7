"""Reading a request body: bounded in size (413) and in time (408), parsed as JSON (400)."""

from __future__ import annotations

import json

import anyio
from starlette.requests import ClientDisconnect, Request

from gateway.errors import ApiError, bad_request

CLIENT_GONE = 499   # nginx's number for a client that closed its request; nobody reads the answer


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
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {str(exc)[:200]}") from None


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body has {size} bytes or more; this gateway takes at most {max_bytes}")
