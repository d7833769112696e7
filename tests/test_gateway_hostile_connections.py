"""The gateway against hostile connections: silent, slow or idle ones, plain HTTP on its HTTPS port,
hang-ups mid-stream and a bounded flood; it closes or refuses them, logs each kind once an interval, serves on."""

from __future__ import annotations

import json
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx2
import openai
import pytest

from cluster_helpers import wait_for
from gateway_helpers import http, openai_client
from gateway_hostile_helpers import CHAT, HEAD_TIMEOUT_S, post, raw, refused
from gateway_hostile_helpers import gateway, model, served  # noqa: F401 - fixtures, asked for by name
from kvcache.cluster import client_tls, start_cluster, wait_healthy
from kvcache.launch import Daemon
from metrics_helpers import scrape
from worker.client import WorkerClient


def gone(sock: socket.socket) -> bool:
    """The gateway closed this connection (a FIN, or a reset for bytes it had not read)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def lines_of(gateway, words: str) -> list[str]:
    return [line for line in gateway.log_path.read_text().splitlines() if words in line]


def test_a_silent_or_slow_connection_is_closed_and_a_slow_body_is_408(gateway, model):
    """Before any request, or a head dribbled a byte at a time, a connection was held forever
    (uvicorn times neither); now --body-timeout bounds the head as it bounds the body."""
    parts = urlsplit(gateway.address)
    silent = socket.create_connection((parts.hostname, parts.port), timeout=30)
    dribbler = socket.create_connection((parts.hostname, parts.port), timeout=30)
    keeper = socket.create_connection((parts.hostname, parts.port), timeout=30)
    try:
        started = time.monotonic()
        keeper.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = b""
        while not answer.endswith(b"}"):   # the whole answer, the connection kept
            answer += keeper.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        keeper.sendall(b"GET /hea")   # a second request on the kept connection, then nothing
        head = b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Slow: " + b"y" * 100
        closed = None
        for byte in head:   # one byte every 0.2 s, never the head's end
            try:
                dribbler.sendall(bytes([byte]))
            except OSError:
                closed = time.monotonic() - started
                break
            time.sleep(0.2)
        assert gone(silent) and gone(keeper)
        assert time.monotonic() - started < HEAD_TIMEOUT_S + 10
        if closed is None:
            assert gone(dribbler)
        else:
            assert HEAD_TIMEOUT_S - 0.5 < closed < HEAD_TIMEOUT_S + 10
    finally:
        for sock in (silent, dribbler, keeper):
            sock.close()
    body = json.dumps({"model": model, "prompt": "a"}).encode()
    slow_body = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body) + 10, body)   # 10 bytes never come
    answer = raw(gateway.address, slow_body, timeout_s=HEAD_TIMEOUT_S + 20)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 3s" in answer, answer
    said = lines_of(gateway, "no whole request head within 3s")
    assert 1 <= len(said) <= 2, said   # one line per interval, with the count


def test_idle_connections_past_uvicorns_limit_are_closed_and_the_gateway_serves_again(served, model, tmp_path):
    """--max-streams 2 lets uvicorn hold 20 connections; 30 silent ones made every other client's
    request a 503 until they went away, which they never did."""
    cluster, _ = served
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(cluster.coordinator_addresses),
            "--max-streams", "2", "--body-timeout", "2"]
    with Daemon("gateway", args, log_path=tmp_path / "limited.log") as limited:
        parts = urlsplit(limited.address)
        idle = [socket.create_connection((parts.hostname, parts.port), timeout=30) for _ in range(30)]
        try:
            time.sleep(0.5)
            assert http(limited.address, "GET", "/health")[0] == 503   # uvicorn's own refusal, over its limit
            assert wait_for(lambda: http(limited.address, "GET", "/health")[0] == 200, timeout_s=15.0, interval_s=0.5)
            assert all(gone(sock) for sock in idle)
        finally:
            for sock in idle:
                sock.close()
        assert "Traceback" not in limited.log_path.read_text()


def test_a_bounded_flood_of_hostile_and_plain_clients_leaves_the_gateway_serving(served, gateway, model):
    """200 requests from 12 threads, at most 90 s: bad bodies, streams dropped mid-way, huge
    refusals, tokenizer calls and plain completions. Then no 500, no traceback, no request left
    on the worker, and a plain request answered as before."""
    cluster, _ = served
    before = scrape(gateway.metrics_url)
    deadline = time.monotonic() + 90.0
    good = json.dumps({"model": model, "prompt": "Fresh bread", "max_tokens": 2, "temperature": 0}).encode()
    streamed = json.dumps({"model": model, "prompt": "Tell me about rye", "max_tokens": 500, "stream": True,
                           "ignore_eos": True, "logprobs": 5, "echo": True}).encode()

    def dropped_stream() -> str:
        parts = urlsplit(gateway.address)
        with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(streamed), streamed))
            seen = b""
            while b"data: " not in seen:
                chunk = sock.recv(4096)
                assert chunk, seen
                seen += chunk
        return "dropped"

    kinds = [
        lambda: post(gateway.address, "/v1/completions", good)[0],
        lambda: post(gateway.address, "/v1/completions", b'{"model": 5, "prompt": [1.5]}')[0],
        lambda: post(gateway.address, "/v1/completions", b"\xff" * 1000)[0],
        lambda: post(gateway.address, "/tokenize", b'{"prompt": "\\ud800"}')[0],
        lambda: post(gateway.address, "/detokenize", json.dumps({"tokens": list(range(300)) * 100}).encode())[0],
        lambda: post(gateway.address, "/v1/chat/completions", json.dumps(
            {"model": model, "messages": CHAT, "max_tokens": 2, "n": 3, "logprobs": True, "top_logprobs": 20}).encode())[0],
        dropped_stream,
    ]

    def one(i: int):
        if time.monotonic() > deadline:
            return "late"
        return kinds[i % len(kinds)]()

    with ThreadPoolExecutor(max_workers=12) as pool:
        outcomes = list(pool.map(one, range(200)))
    assert "late" not in outcomes and set(outcomes) <= {200, 400, "dropped"}, outcomes
    [worker] = cluster.role("worker")
    with WorkerClient(worker.address) as probe:
        assert wait_for(lambda: probe.info().running == 0, timeout_s=30.0), "dropped streams kept running"
    assert post(gateway.address, "/v1/completions", good)[0] == 200
    after = scrape(gateway.metrics_url)
    assert after.sum("kvcache_gateway_requests_total", status="500") == before.sum("kvcache_gateway_requests_total",
                                                                                    status="500") == 0
    log = gateway.log_path.read_text()
    assert "Traceback" not in log and " failed" not in log, log[-3000:]
    assert len(lines_of(gateway, "went away or stopped reading")) <= len(outcomes) // len(kinds) + 1


def test_https_serves_tls_and_answers_plain_http_with_a_400_naming_https(tmp_path, certs):
    """On the HTTPS port a plain HTTP request got no answer at all (curl: "Empty reply from
    server"); now a 400 in OpenAI's shape says to use https://, TLS is served as before, and
    bytes that are neither, or nothing, get the connection closed."""
    key = "hostile-tests-key-0123456789"
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"tests {key}\n")
    with start_cluster(tmp_path / "logs", nodes=1, workers=1, coordinators=1, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB", tls_dir=certs, tokens_file=tokens_file) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=1,
                     client_options={**client_tls(certs), "token": key})
        args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(cluster.coordinator_addresses),
                "--tls-ca", str(certs / "ca.pem"), "--tls-cert", str(certs / "gateway.pem"),
                "--tls-key", str(certs / "gateway.key"), "--body-timeout", str(HEAD_TIMEOUT_S)]
        with Daemon("gateway", args, log_path=tmp_path / "https.log") as gateway:
            assert gateway.address.startswith("https://")
            trusted = ssl.create_default_context(cafile=str(certs / "ca.pem"))
            with httpx2.Client(verify=trusted) as https, \
                    openai.OpenAI(base_url=gateway.address + "/v1", api_key=key, http_client=https,
                                  max_retries=0, timeout=60) as client:
                chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0,
                                                        stream=True, logprobs=2))
                assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) == 3
                with pytest.raises(openai.AuthenticationError):
                    client.with_options(api_key="k" * 5000).models.list()
            plain = gateway.address.replace("https://", "http://", 1)
            for _ in range(3):
                status, _, data = http(plain, "GET", "/v1/models?x=1")
                refused(status, json.loads(data), 400, None, f"send the request to {gateway.address}/v1/models?x=1")
            assert raw(gateway.address, b"\x16\x03\x01\x00\x05hello" + b"\x00" * 100) == b""
            started = time.monotonic()
            assert raw(gateway.address, b"", timeout_s=30) == b""              # nothing sent
            assert raw(gateway.address, b"", timeout_s=30, context=trusted) == b""   # a handshake, then nothing
            assert time.monotonic() - started < 2 * HEAD_TIMEOUT_S + 10
            with openai_client(gateway.address, key) as untrusted:   # the system's CAs: not the cluster's
                with pytest.raises(openai.APIConnectionError):
                    untrusted.models.list()
        log = (tmp_path / "https.log").read_text()
        assert "Traceback" not in log and len([line for line in log.splitlines() if "plain HTTP" in line]) == 1, log


def test_a_bug_is_one_traceback_per_interval_and_uvicorns_lines_are_limited(caplog):
    """A failure a request can make, a flood of them can make: the app's traceback is logged once
    per interval with the count, uvicorn's copy of it never, its per-request warnings limited."""
    import asyncio
    import logging

    from starlette.requests import Request

    from gateway import app
    from gateway.connections import LimitedWarnings

    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""})
    with caplog.at_level(logging.INFO, logger="gateway"):
        for _ in range(5):
            try:
                raise RuntimeError("a bug")
            except RuntimeError as exc:
                assert asyncio.run(app._bug(request, exc)).status_code == 500
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) <= 1 and all(r.exc_info for r in failed)
    limited = LimitedWarnings()

    def record(level: int, message: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", level, __file__, 1, message, (), None)

    assert not limited.filter(record(logging.ERROR, "Exception in ASGI application\n"))
    said = [limited.filter(record(logging.WARNING, "Invalid HTTP request received.")) for _ in range(100)]
    assert said == [True] + [False] * 99
    assert limited.filter(record(logging.INFO, "Started server process"))
