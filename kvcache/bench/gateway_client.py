"""The load bench's HTTP path: requests through `kvcache gateway` as streamed /v1/completions,
with the interface of coordinator.client.Client.generate (Piece events, then one Finished), so a
pass through HTTP runs the same code as one through gRPC. Plain http.client on a kept-alive
connection per client thread: the bench measures the gateway, not an HTTP library."""

from __future__ import annotations

import http.client
import json
import socket
from typing import Iterator
from urllib.parse import urlsplit

import grpc

from base.generation import Finished, Piece, Usage
from coordinator.client import ClusterError


class GatewayClient:
    def __init__(self, url: str, model: str, timeout: float = 600.0):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--gateway takes http://HOST:PORT, got {url!r}")
        self.host, self.port, self.model, self.timeout = parts.hostname, parts.port or 80, model, timeout
        self._connection: http.client.HTTPConnection | None = None

    def generate(self, prompt: str | list[int], session_id: str = "", max_tokens: int = 16, no_cache: bool = False,
                 ignore_eos: bool = False) -> Iterator[Piece | Finished]:
        if no_cache:
            raise ValueError("the OpenAI API has no no_cache: the gateway pass runs with the cache")
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos, "return_token_ids": True,
                "user": session_id or None}
        try:
            response = self._post("/v1/completions", json.dumps(body).encode())
            if response.status != 200:
                raise ClusterError(grpc.StatusCode.UNKNOWN, f"HTTP {response.status}: {response.read()[:300]!r}")
            reason = None
            for data in _events(response):
                if data == b"[DONE]":
                    continue   # read on to the body's last chunk, so the connection can carry the next request
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ClusterError(grpc.StatusCode.UNKNOWN, chunk["error"]["message"])
                if chunk["choices"]:
                    choice = chunk["choices"][0]
                    reason = choice["finish_reason"] or reason
                    if choice["finish_reason"] is None:
                        yield Piece(choice["text"], choice.get("token_ids", []))
                if chunk.get("usage"):
                    yield Finished(_usage(chunk["usage"]), reason or "stop")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.close()
            raise ClusterError(grpc.StatusCode.UNAVAILABLE, f"gateway: {exc!r}") from None

    def _post(self, path: str, body: bytes) -> http.client.HTTPResponse:
        for attempt in (1, 2):   # a kept-alive connection the server closed meanwhile: once more on a new one
            if self._connection is None:
                self._connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
                self._connection.connect()
                # http.client sends headers and body in two writes: without this, Nagle holds the body
                # until the server's delayed ACK of the headers (~40 ms per request on Linux).
                self._connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                self._connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
                return self._connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def __enter__(self) -> "GatewayClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _events(response: http.client.HTTPResponse) -> Iterator[bytes]:
    """The `data:` payloads of a chunked event stream, each as soon as its chunk arrives.
    (HTTPResponse's own line iteration over a chunked body waited for more bytes than one event:
    it added tens of milliseconds to the first token.)"""
    fp, pending = response.fp, b""
    try:
        while True:
            size = int(fp.readline(1024).split(b";")[0], 16)
            if size == 0:
                fp.readline(1024)
                return
            pending += fp.read(size)
            fp.readline(1024)
            *whole, pending = pending.split(b"\n\n")
            for event in whole:
                if event.startswith(b"data: "):
                    yield event[len(b"data: "):]
    finally:
        response.close()


def _usage(body: dict) -> Usage:
    ours = body.get("kvcache", {})
    return Usage(prompt_tokens=body["prompt_tokens"], cached_tokens_local=ours.get("cached_tokens_local", 0),
                 cached_tokens_remote=ours.get("cached_tokens_remote", 0),
                 computed_tokens=ours.get("computed_tokens", 0), completion_tokens=body["completion_tokens"],
                 ttft_ms=ours.get("ttft_ms", 0.0))
