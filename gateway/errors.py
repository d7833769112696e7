"""Errors in OpenAI's JSON shape ({"error": {"message", "type", "param", "code"}}) with the HTTP
status a client of OpenAI's API expects; the cluster's gRPC codes mapped onto them."""

from __future__ import annotations

import grpc
from starlette.responses import JSONResponse

# HTTP status -> OpenAI's error type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}

# A refusal by the cluster -> HTTP status. INTERNAL is ours (a worker failed), never a user's mistake.
_STATUS_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 503,
}


class ApiError(Exception):
    """A request the gateway answers with an error: `status`, and OpenAI's message, param and code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_cluster(code: grpc.StatusCode, details: str, key_sent: bool = False) -> ApiError:
    """`key_sent`: the caller sent `Authorization: Bearer KEY`. A refusal for want of a key is said
    in HTTP's words: the coordinators' own message names gRPC metadata, which an HTTP caller has not."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        problem = "the cluster does not know this API key" if key_sent else "this request needs an API key"
        return ApiError(401, f"{problem}: send one the cluster knows in the header `Authorization: Bearer KEY`",
                        code="invalid_api_key")
    status = _STATUS_OF_CODE.get(code, 500)
    return ApiError(status, details, code=code.name.lower())


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def shown(name: str, limit: int = 100) -> str:
    """A client's name as an error message repeats it: cut to `limit` characters."""
    return name if len(name) <= limit else name[:limit] + f"... ({len(name)} characters)"
