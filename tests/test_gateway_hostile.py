"""The gateway against hostile and careless clients: wrong JSON types, missing, huge or malformed
values, lists of every size, lone surrogates, NaN, odd headers and keys, unknown models, slow or
silent connections, plain HTTP on the HTTPS port, clients that hang up mid-stream and a bounded
flood of all of these. Each is refused in OpenAI's error shape with the status and field that fit
(never a 500), cheaply, with no traceback in the gateway's log, and the gateway serves on.

Real processes on loopback: a `kvcache gateway` in front of a small cluster (gateway_helpers),
and for HTTPS one in front of a secure cluster; every process is stopped by its own pid, every
load loop is bounded in count and time."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx2
import openai
import pytest

from cluster_helpers import wait_for
from gateway_helpers import cluster_with_gateway, http, openai_client
from kvcache.cluster import client_tls, start_cluster, wait_healthy
from kvcache.launch import Daemon
from metrics_helpers import scrape
from openai_schema import check_error
from worker.client import WorkerClient

HEAD_TIMEOUT_S = 3.0   # the gateways' --body-timeout here: a request's head, then its body


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


def gone(sock: socket.socket) -> bool:
    """The gateway closed this connection (a FIN, or a reset for bytes it had not read)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


def lines_of(gateway, words: str) -> list[str]:
    return [line for line in gateway.log_path.read_text().splitlines() if words in line]


CHAT = [{"role": "user", "content": "hi"}]
COMPLETION_REFUSALS = [
    ({"max_tokens": "2"}, "max_tokens", "valid integer, got a string"),
    ({"max_tokens": True}, "max_tokens", "got a boolean"),
    ({"max_tokens": 2.0}, "max_tokens", "got a number written with a point"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": 10**9}, "max_tokens", "between 1 and 4096"),       # the worker's refusal
    ({"stream": "yes"}, "stream", "valid boolean, got a string"),
    ({"echo": 1}, "echo", "valid boolean, got an integer"),
    ({"n": 9}, "n", "less than or equal to 8"),
    ({"n": "2"}, "n", "got a string"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ({"logprobs": True}, "logprobs", "got a boolean"),
    ({"prompt": [True, False]}, "prompt", "prompt.0 is a boolean"),
    ({"prompt": [1.5]}, "prompt", "prompt.0 is a number with a fraction"),
    ({"prompt": [-1]}, "prompt", "greater than or equal to 0"),
    ({"prompt": [2**32]}, "prompt", "less than or equal to 4294967295"),
    ({"prompt": [299, 300, 5000]}, "prompt", "token ids must be in [0, 300)"),   # the vocabulary: the worker's
    ({"prompt": {"text": "a"}}, "prompt", "got an object"),
    ({"prompt": None}, "prompt", "got null"),
    ({"prompt": ["a"] * 65}, "prompt", "has 65 items; at most 64"),
    ({"prompt": [[1], []]}, "prompt", "prompt[1]: is an empty list of token ids"),
    ({"prompt": ["a", [1]]}, "prompt", "a list of prompts (texts, or lists of token ids)"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": [1] * 5000}, "prompt", "5000 tokens"),
    ({"prompt": "x" * 200_000}, "prompt", "200000 characters"),
    ({"stop": ["a"] * 5}, "stop", "has 5 items; at most 4"),
    ({"stop": "x" * 300}, "stop", "at most 256 characters"),
    ({"stop": [1]}, "stop", "stop.0 is an integer"),
    ({"model": None}, "model", "got null"),
    ({"temperature": "hot"}, "temperature", "got a string"),
    ({"seed": 1.5}, "seed", "got a number with a fraction"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "valid boolean"),
    ({"user": "u" * 300}, "user", "at most 256 characters"),
    ({"best_of": 2}, "best_of", "not supported"),
]
CHAT_REFUSALS = [
    ({"max_tokens": 0, "echo": True}, "max_tokens", "greater than or equal to 1"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
    ({"logprobs": 1}, "logprobs", "valid boolean, got an integer"),
    ({"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ({"messages": "hi"}, "messages", "valid list, got a string"),
    ({"messages": []}, "messages", "has 0 items; at least 1"),
    ({"messages": CHAT * 1025}, "messages", "has 1025 items; at most 1024"),
    ({"messages": [None]}, "messages.0", "got null"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "got an integer"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "'assistant'"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages.0.content", "should be 'text'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]}, "messages.0.content",
     "has 1025 items; at most 1024"),
    ({"messages": [{"role": "user", "content": "x" * 200_000}]}, "messages", "characters; this worker reads"),
    ({"max_completion_tokens": "x"}, "max_completion_tokens", "got a string"),
    ({"tools": [{"type": "function"}]}, "tools", "not supported"),
]
TOKENIZER_REFUSALS = [
    ("/tokenize", {"prompt": 5}, "prompt", "got an integer"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "got an array"),
    ("/tokenize", {"prompt": "x" * 200_000}, "prompt", "200000 characters"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x" * 200_000}]}, "messages", "characters"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "got a string"),
    ("/tokenize", {"messages": CHAT * 1025}, "messages", "has 1025 items; at most 1024"),
    ("/tokenize", {}, None, "send a prompt or messages"),
    ("/detokenize", {"tokens": [300]}, "tokens", "not a token id of this model"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0", "greater than or equal to 0"),
    ("/detokenize", {"tokens": [True]}, "tokens.0", "got a boolean"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0", "got a string"),
    ("/detokenize", {"tokens": [[5]]}, "tokens.0", "got an array"),
    ("/detokenize", {"tokens": 5}, "tokens", "valid list"),
    ("/detokenize", {"tokens": [5] * 200_000}, "tokens", "has 200000 items; at most 131072"),
]


@pytest.mark.parametrize("fields, param, words", COMPLETION_REFUSALS)
def test_a_bad_completion_field_is_a_400_naming_it(gateway, model, fields, param, words):
    body = {"model": model, "prompt": "a", "max_tokens": 1, **fields}
    refused(*post(gateway.address, "/v1/completions", json.dumps(body).encode()), 400, param, words)


@pytest.mark.parametrize("fields, param, words", CHAT_REFUSALS)
def test_a_bad_chat_field_is_a_400_naming_it(gateway, model, fields, param, words):
    body = {"model": model, "messages": CHAT, "max_tokens": 1, **fields}
    refused(*post(gateway.address, "/v1/chat/completions", json.dumps(body).encode()), 400, param, words)


@pytest.mark.parametrize("path, body, param, words", TOKENIZER_REFUSALS)
def test_a_bad_tokenizer_field_is_a_400_naming_it(gateway, path, body, param, words):
    refused(*post(gateway.address, path, json.dumps(body).encode()), 400, param, words)


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", b"", None, "the request body is empty"),
    ("/v1/completions", b"   ", None, "the request body is empty"),
    ("/v1/completions", b'{"model": "M", "prompt": "\xff"}', None, "not UTF-8 (byte 0xff"),
    ("/v1/completions", '{"model": "M", "prompt": "a"}'.encode("utf-16"), None, "not UTF-8"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "temperature": NaN}', None, "NaN is not a JSON number"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "top_p": -Infinity}', None, "-Infinity is not a JSON number"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "temperature": 1e999}', None, "beyond a double's range"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "seed": 1' + b"0" * 5000 + b"}", None, "too many digits"),
    ("/v1/completions", b"1e999999", None, "beyond a double's range"),
    ("/v1/completions", b"[]", None, "must be a JSON object, got an array"),
    ("/v1/completions", b"null", None, "must be a JSON object, got null"),
    ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    ("/v1/completions", b"model=M&prompt=a", None, "not valid JSON"),
    ("/v1/completions", b'{"model": "M", "prompt": "\\ud800", "max_tokens": 1}', "prompt", "lone UTF-16 surrogate"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "stop": ["\\udc00"]}', "stop.0", "lone UTF-16 surrogate"),
    ("/v1/completions", b'{"model": "M", "prompt": "a", "\\ud800": 1}', None, "lone UTF-16 surrogate"),
    ("/v1/chat/completions", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800x"}]}',
     "messages.0.content", "lone UTF-16 surrogate"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt", "lone UTF-16 surrogate"),   # was a 500 with a traceback
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages.0.content", "surrogate"),
])
def test_a_body_that_is_not_one_json_object_of_text_is_a_400(gateway, model, path, body, param, words):
    refused(*post(gateway.address, path, body.replace(b'"M"', json.dumps(model).encode())), 400, param, words)


def test_a_paired_surrogate_is_text_and_served(gateway, model):
    body = b'{"model": "M", "prompt": "bread \\ud83c\\udf5e", "max_tokens": 1}'.replace(b'"M"', json.dumps(model).encode())
    status, answer = post(gateway.address, "/v1/completions", body)
    assert status == 200, answer
    status, answer = post(gateway.address, "/tokenize", b'{"prompt": "\\ud83c\\udf5e"}')
    assert status == 200 and answer["count"] >= 1, answer


@pytest.mark.parametrize("path, items", [
    ("/v1/completions", {"prompt": [1.5] * 1_000_000}), ("/v1/completions", {"prompt": [1.5] * 131_072}),
    ("/v1/completions", {"prompt": [[1.5] * 131_072]}), ("/v1/completions", {"prompt": ["a", 1] * 65_536}),
    ("/detokenize", {"tokens": ["a"] * 131_072}), ("/detokenize", {"tokens": ["a"] * 800_000}),
    ("/v1/chat/completions", {"messages": [1] * 1024}), ("/v1/chat/completions", {"messages": [1] * 1_000_000}),
    ("/tokenize", {"messages": [{}] * 1_000_000}),
])
def test_a_list_of_wrong_items_costs_about_one(gateway, model, path, items):
    """A list is refused at once for its length, else at its first wrong item: a 4 MiB body of
    them was minutes of the event loop (millions of errors collected), every other client waiting."""
    body = json.dumps({"model": model, "max_tokens": 1, **items}, separators=(",", ":")).encode()
    assert len(body) < 4 * 1024 * 1024
    started = time.monotonic()
    status, answer = post(gateway.address, path, body)
    assert status == 400 and answer["error"]["param"] is not None, answer
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_a_model_that_does_not_exist_is_a_404_whose_message_stays_short(gateway, path):
    fields = {"/v1/completions": {"prompt": "a"}, "/v1/chat/completions": {"messages": CHAT},
              "/tokenize": {"prompt": "a"}, "/detokenize": {"tokens": [1]}}[path]
    for name in ("no-such-model", "x" * 100_000):
        body = {"model": name, **fields}
        status, answer = post(gateway.address, path, json.dumps(body).encode())
        refused(status, answer, 404, "model", "does not exist")
        assert answer["error"]["code"] == "model_not_found"
    for page in ("/v1/models/no-such-model", "/tokenizer_info?model=" + "x" * 5000):
        status, _, data = http(gateway.address, "GET", page)
        refused(status, json.loads(data), 404, "model", "does not exist")


def test_keys_that_cannot_be_keys_are_401_and_two_of_them_a_400(gateway, model):
    body = json.dumps({"model": model, "prompt": "a", "max_tokens": 1}).encode()
    refused(*post(gateway.address, "/v1/completions", body, {"Authorization": "Bearer " + "k" * 60_000}), 401, None,
            "has 60000 characters; at most 1024")   # was a 503: gRPC metadata too large
    head = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nContent-Length: %d\r\n" % len(body)
    answer = raw(gateway.address, head + b"Authorization: Bearer \xff\xfe\r\n\r\n" + body)   # was a 500
    assert answer.startswith(b"HTTP/1.1 401 ") and b"printable ASCII" in answer, answer
    answer = raw(gateway.address, head + b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"2 Authorization headers" in answer, answer
    # A scheme other than Bearer carries no key: this cluster wants none.
    assert post(gateway.address, "/v1/completions", body, {"Authorization": "Basic Zm9vOmJhcg=="})[0] == 200


def test_several_choices_and_a_zero_token_echo_are_served(gateway, model):
    body = {"model": model, "prompt": "Rye and", "max_tokens": 0, "echo": True, "logprobs": 20, "n": 8}
    status, answer = post(gateway.address, "/v1/completions", json.dumps(body).encode())
    assert status == 200 and len(answer["choices"]) == 8, answer
    assert all(c["text"] == "Rye and" and c["logprobs"]["token_logprobs"][0] is None for c in answer["choices"])


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
