"""The OpenAI-compatible gateway as a real process in front of a real local cluster, spoken to with
the real `openai` package: models, completions and chats with and without streaming, usage that
shows the cache (a shared system prompt, a growing chat), greedy answers equal to gRPC generate's,
errors in OpenAI's shape with the right statuses (never a 500 for a client's mistake), and a client
that hangs up mid-stream freeing its request on the worker."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import openai
import pytest

from cluster_helpers import wait_for
from base.generation import Finished, Piece
from coordinator.client import Client
from metrics_helpers import scrape
from gateway_helpers import PAGE_TOKENS, cluster_with_gateway, http, openai_client, post_json
from kvcache.launch import Daemon
from worker.client import WorkerClient

SYSTEM = ("You are the support assistant of a small bakery on the corner of the market square. Be kind, "
          "be brief, and never invent prices or opening hours that you were not told about.")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with cluster_with_gateway(tmp_path_factory.mktemp("gateway"), "--metrics") as (cluster, gateway):
        yield cluster, gateway


@pytest.fixture(scope="module")
def gateway(served):
    return served[1]


@pytest.fixture(scope="module")
def cluster(served):
    return served[0]


@pytest.fixture(scope="module")
def api(gateway):
    with openai_client(gateway.address) as client:
        yield client


@pytest.fixture(scope="module")
def model(api):
    [only] = api.models.list().data
    return only.id


def grpc_text(cluster, prompt, **options) -> tuple[str, Finished]:
    text, finished = [], None
    with Client(cluster.coordinator_addresses) as client:
        for event in client.generate(prompt, **options):
            if isinstance(event, Piece):
                text.append(event.text)
            else:
                finished = event
    return "".join(text), finished


def test_models_lists_the_workers_model(api, cluster, model):
    with Client(cluster.coordinator_addresses) as client:
        workers = [m.model for m in client.status().members if m.role == "worker"]
    assert workers == [model] and model.startswith("chat")
    [listed] = api.models.list().data
    assert listed.owned_by == "kvcache" and listed.object == "model" and listed.created > 0
    assert api.models.retrieve(model).id == model


def test_health(gateway):
    status, _, body = http(gateway.address, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_greedy_completion_equals_grpc_generate(api, cluster, model):
    prompt = "The bakery opens at seven and the first bread comes out of the oven at"
    reply = api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    expected, finished = grpc_text(cluster, prompt, max_tokens=12, temperature=0.0)
    [choice] = reply.choices
    assert choice.text == expected and choice.finish_reason == finished.finish_reason
    assert reply.object == "text_completion" and reply.model == model
    assert reply.usage.prompt_tokens == finished.usage.prompt_tokens
    assert reply.usage.completion_tokens == finished.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    # Token ids as the prompt give the same answer as the text they encode.
    ids = api.completions.create(model=model, prompt=[5, 17, 42, 99, 7], max_tokens=6, temperature=0)
    assert ids.choices[0].text == grpc_text(cluster, [5, 17, 42, 99, 7], max_tokens=6, temperature=0.0)[0]


def test_greedy_chat_equals_grpc_generate_streamed_or_not(api, cluster, model):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Do you sell rye bread?"}]
    whole = api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    expected, finished = grpc_text(cluster, messages, max_tokens=10, temperature=0.0)
    [choice] = whole.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason == finished.finish_reason and whole.object == "chat.completion"

    chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [finished.finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage.prompt_tokens == finished.usage.prompt_tokens
    assert last.usage.completion_tokens == finished.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage no chunk carries usage.
    plain = list(api.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                             stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_streamed_events_end_with_done(gateway, model):
    body = {"model": model, "prompt": "Fresh croissants every", "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    status, headers, data = http(gateway.address, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    parsed = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] == 5
    assert parsed[-2]["choices"][0]["finish_reason"] == "length"


def test_shared_system_prompt_is_served_from_the_cache(api, model):
    first = api.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is there bread left?"}])
    second = api.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Any cakes today?"}])
    cached = second.usage.prompt_tokens_details.cached_tokens
    ours = second.usage.model_extra["kvcache"]
    assert cached >= PAGE_TOKENS and cached == ours["cached_tokens_local"] + ours["cached_tokens_remote"]
    assert ours["computed_tokens"] == second.usage.prompt_tokens - cached and ours["ttft_ms"] > 0
    assert first.usage.prompt_tokens_details.cached_tokens <= cached


def test_a_growing_chat_hits_the_cache_for_its_earlier_turns(api, model):
    messages = [{"role": "system", "content": "You answer in one short sentence."},
                {"role": "user", "content": "Which bread keeps longest, rye or white?"}]
    for turn in range(3):
        reply = api.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                            user="growing-chat")
        if turn:
            # Every full page of the previous turn's prompt came from the cache.
            assert reply.usage.prompt_tokens_details.cached_tokens >= previous // PAGE_TOKENS * PAGE_TOKENS > 0
        previous = reply.usage.prompt_tokens
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And what about turn {turn + 2}?"}]


def test_n_choices_are_n_requests_seeded_seed_plus_index(api, model):
    prompt = "Four loaves, three rolls and"
    reply = api.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1, seed=7, n=3,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    alone = [api.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1, seed=7 + i,
                                    extra_body={"ignore_eos": True}) for i in range(3)]
    assert [c.text for c in reply.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in reply.choices}) > 1   # different seeds, different samples
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == 18 == sum(a.usage.completion_tokens for a in alone)


def test_n_streamed_choices_interleave_by_index_and_end_with_one_usage(api, model):
    messages = [{"role": "user", "content": "Name two breads."}]
    whole = api.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=1, seed=3, n=2)
    stream = api.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=1, seed=3, n=2,
                                         stream=True, stream_options={"include_usage": True})
    texts, reasons, usages = {0: "", 1: ""}, {}, []
    for chunk in stream:
        if chunk.usage:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            assert choice.index not in reasons, "a chunk after its choice's finish"
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    [usage] = usages
    assert usage.completion_tokens == whole.usage.completion_tokens == 10


def test_unknown_model_is_not_found(api):
    with pytest.raises(openai.NotFoundError) as raised:
        api.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)
    assert raised.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("bad", [{"temperature": 3.5}, {"temperature": -1}, {"top_p": 0}, {"n": 9},
                                 {"max_tokens": 0}, {"max_tokens": 10**9}, {"stop": ["a", "b", "c", "d", "e"]},
                                 {"logprobs": 3}, {"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21},
                                 {"stream_options": {"include_usage": True}}])
def test_bad_parameters_are_bad_requests(api, model, bad):
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                    **{"max_tokens": 2, **bad})
    assert raised.value.status_code == 400 and raised.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [
    b"{not json", b"[]", b'"a string"', b"{}", b'{"model": "x"}', b'{"model": 5, "prompt": "a"}',
    b'{"model": "M", "prompt": ""}', b'{"model": "M", "prompt": []}', b'{"model": "M", "prompt": [[1], []]}',
    b'{"model": "M", "prompt": [-1]}', b'{"model": "M", "prompt": "a", "seed": 1e400}',
    b'{"model": "M", "prompt": "a", "temperature": NaN}', b'{"model": "M", "prompt": "a", "max_tokens": "many"}',
    b"[" * 100_000 + b"]" * 100_000, b"\xff\xfe garbage",
])
def test_malformed_bodies_get_400_in_openai_shape(gateway, model, body):
    status, _, data = http(gateway.address, "POST", "/v1/completions", body.replace(b'"M"', json.dumps(model).encode()))
    assert status == 400, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def test_chat_bodies_the_worker_refuses_are_400_not_500(gateway, model):
    for messages in ([], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": [{"type": "image"}]}]):
        status, body = post_json(gateway.address, "/v1/chat/completions", {"model": model, "messages": messages})
        assert status == 400, body


def test_oversized_body_unknown_route_and_method(gateway):
    status, _, data = http(gateway.address, "POST", "/v1/completions", b"x" * (5 * 1024 * 1024))
    assert status == 413 and json.loads(data)["error"]["message"]
    status, _, data = http(gateway.address, "GET", "/v1/nothing-here")
    assert status == 404 and json.loads(data)["error"]["type"] == "invalid_request_error"
    status, _, data = http(gateway.address, "GET", "/v1/completions")
    assert status == 405 and "error" in json.loads(data)


def test_a_client_that_hangs_up_mid_stream_frees_its_worker(api, cluster, model):
    [worker] = cluster.role("worker")
    before = scrape(worker.metrics_url)
    with WorkerClient(worker.address) as probe:
        stream = api.completions.create(model=model, prompt="Tell me everything about sourdough.", max_tokens=3000,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        for seen, _ in enumerate(stream, start=1):
            if seen == 3:
                break
        assert probe.info().running == 1
        stream.close()   # the HTTP connection is closed mid-stream
        assert wait_for(lambda: probe.info().running == 0, timeout_s=15.0), "the request kept running on its worker"
    # It ended because it was aborted, long before its 3,000 tokens.
    after = scrape(worker.metrics_url)
    assert after.sum("kvcache_worker_requests_total", finish_reason="abort") - \
        before.sum("kvcache_worker_requests_total", finish_reason="abort") == 1
    generated = after.sum("kvcache_worker_generation_tokens_total") - before.sum("kvcache_worker_generation_tokens_total")
    assert 3 <= generated < 3000


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="--send-timeout is Linux's TCP_USER_TIMEOUT")
def test_a_client_that_stops_reading_is_dropped_and_frees_its_worker(cluster, model, tmp_path):
    """A raw client with a small receive buffer opens a long stream and never reads: once its window
    has been closed for --send-timeout seconds the gateway's kernel drops the connection, and the
    request is cancelled on its worker, long before its tokens or its deadline (600 s) run out."""
    [worker] = cluster.role("worker")
    before = scrape(worker.metrics_url)
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(cluster.coordinator_addresses)]
    # A fifth of a second: the tiny model makes its 4,000 tokens in a few seconds, and the stream must be
    # dropped before they are all made for the test to tell a drop from an end.
    with Daemon("gateway", [*args, "--send-timeout", "0.2"], log_path=tmp_path / "stalled.log") as gateway, \
            WorkerClient(worker.address) as probe:
        body = json.dumps({"model": model, "prompt": "Tell me everything about rye.", "max_tokens": 4000,
                           "temperature": 0, "stream": True, "ignore_eos": True}).encode()
        parts = urlsplit(gateway.address)
        reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connect: the window stays small
        try:
            reader.connect((parts.hostname, parts.port))
            reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_for(lambda: probe.info().running == 1, timeout_s=30.0), "the request never started"
            # ...and is never read from again.
            assert wait_for(lambda: probe.info().running == 0, timeout_s=60.0), "the stalled stream kept its worker"
        finally:
            reader.close()
        log = gateway.log_path.read_text()
    after = scrape(worker.metrics_url)
    assert after.sum("kvcache_worker_requests_total", finish_reason="abort") - \
        before.sum("kvcache_worker_requests_total", finish_reason="abort") == 1
    generated = after.sum("kvcache_worker_generation_tokens_total") - before.sum("kvcache_worker_generation_tokens_total")
    assert generated < 4000
    assert log.count("stopped reading") == 1, log


def test_a_coordinator_that_is_down_is_skipped(api, cluster, model, tmp_path):
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(["127.0.0.1:1", *cluster.coordinator_addresses])]
    prompt = "Rye, spelt and"
    expected = api.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    with Daemon("gateway", args, log_path=tmp_path / "skips.log") as skipping, \
            openai_client(skipping.address) as other:
        assert [m.id for m in other.models.list().data] == [model]
        assert other.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0).choices[0].text == expected


def test_sigterm_stops_the_gateway_with_one_line_and_exit_0(cluster, tmp_path):
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(cluster.coordinator_addresses)]
    gateway = Daemon("gateway", args, log_path=tmp_path / "stops.log")
    try:
        assert http(gateway.address, "GET", "/health")[0] == 200
    finally:
        code = gateway.stop(timeout_s=15.0)
    assert code == 0
    log = (tmp_path / "stops.log").read_text()
    assert [line for line in log.splitlines() if line.endswith(" stopped")] != [], log
    assert log.count(" stopped\n") == 1 and "Traceback" not in log, log


def test_a_saturated_gateway_answers_429_and_one_without_a_cluster_503(cluster, model, tmp_path):
    args = ["--host", "127.0.0.1", "--port", "0"]
    with Daemon("gateway", [*args, "--coordinators", ",".join(cluster.coordinator_addresses), "--max-streams", "1"],
                log_path=tmp_path / "busy.log") as busy, \
            openai_client(busy.address) as api:
        holding = api.completions.create(model=model, prompt="Hold on", max_tokens=3000, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        try:
            next(iter(holding))
            with pytest.raises(openai.RateLimitError) as raised:
                api.completions.create(model=model, prompt="Me too", max_tokens=2)
            assert raised.value.response.headers["retry-after"] == "1"
        finally:
            holding.close()
        with pytest.raises(openai.BadRequestError, match="runs at most 1 at once"):   # never servable: not a 429
            api.completions.create(model=model, prompt=["Me", "too"], max_tokens=2)
    with Daemon("gateway", [*args, "--coordinators", "127.0.0.1:1"], log_path=tmp_path / "alone.log") as alone, \
            openai_client(alone.address) as api:
        with pytest.raises(openai.APIStatusError) as raised:
            api.completions.create(model=model, prompt="Anyone?", max_tokens=2)
        assert raised.value.status_code == 503
        assert http(alone.address, "GET", "/health")[0] == 503


def test_metrics_count_requests_and_the_usage_they_reported(api, gateway, model):
    before = scrape(gateway.metrics_url)
    reply = api.completions.create(model=model, prompt="Metrics, please: how many loaves", max_tokens=3, temperature=0)
    after = scrape(gateway.metrics_url)

    def delta(name, **labels):
        return after.sum(name, **labels) - before.sum(name, **labels)

    assert delta("kvcache_gateway_requests_total", route="/v1/completions", status="200") == 1
    assert delta("kvcache_gateway_prompt_tokens_total") == reply.usage.prompt_tokens
    assert delta("kvcache_gateway_prompt_tokens_total", source="computed") == \
        reply.usage.model_extra["kvcache"]["computed_tokens"]
    assert delta("kvcache_gateway_generation_tokens_total") == reply.usage.completion_tokens == 3
    assert delta("kvcache_gateway_request_duration_seconds_count", route="/v1/completions") == 1
    assert after.value("kvcache_gateway_running_requests") == 0
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="x", max_tokens=1)
    assert scrape(gateway.metrics_url).sum("kvcache_gateway_requests_total", route="/v1/completions", status="404") >= 1
