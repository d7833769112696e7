"""What the hostile-gateway tests share: a gateway with a short --body-timeout in front of a small
cluster (module fixtures), raw and JSON requests to it, and the check of an OpenAI-shaped refusal."""

from __future__ import annotations

import json
import socket
import ssl
from urllib.parse import urlsplit

import pytest

from gateway_helpers import cluster_with_gateway, http
from openai_schema import check_error

HEAD_TIMEOUT_S = 3.0   # the gateways' --body-timeout here: a request's head, then its body
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with cluster_with_gateway(tmp_path_factory.mktemp("gateway-hostile"), "--metrics", "--body-timeout",
                              str(HEAD_TIMEOUT_S), nodes=1) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(served):
    return served[1]


@pytest.fixture(scope="module")
def model(gateway):
    status, _, data = http(gateway.address, "GET", "/v1/models")
    [only] = json.loads(data)["data"]
    return only["id"]


def raw(address: str, data: bytes, timeout_s: float = 30.0, context: ssl.SSLContext | None = None) -> bytes:
    """Send bytes on a fresh connection and read until the gateway closes it."""
    parts = urlsplit(address)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    try:
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=parts.hostname)
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out
    finally:
        sock.close()


def post(address: str, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    status, _, data = http(address, "POST", path, body, headers=headers, timeout_s=60.0)
    return status, json.loads(data)


def refused(status: int, answer: dict, expected_status: int, param: str | None, words: str) -> None:
    assert status == expected_status, answer
    check_error(answer)
    assert answer["error"]["param"] == param, answer
    assert words in answer["error"]["message"], answer
    assert len(answer["error"]["message"]) < 600, answer
