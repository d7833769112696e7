"""The gateway as evaluation and load tools expect OpenAI's API (and vLLM's additions to it) to
be, on a cluster that wants client keys (a tokens file): every kind of reply and streamed chunk
in OpenAI's published schema (openai_schema.py), and a refusal for want of a key in HTTP's
words. A real `kvcache gateway` process, spoken to with the real `openai` client and plain HTTP
(httpx2, which the openai package is built on)."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest

from gateway_helpers import cluster_with_gateway, http, openai_client
from openai_schema import check_body, check_error

KEY = "gateway-tests-key-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with cluster_with_gateway(tmp_path_factory.mktemp("gateway-openai"), metrics=False, nodes=1, key=KEY) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(served):
    return served[1]


@pytest.fixture(scope="module")
def api(gateway):
    with openai_client(gateway.address, KEY) as client:
        yield client


@pytest.fixture(scope="module")
def model(api):
    [only] = api.models.list().data
    return only.id


def post(gateway, path: str, body: dict) -> tuple[int, list[dict]]:
    """(status, the bodies): one for a JSON answer, one per event of a stream (without [DONE])."""
    reply = httpx2.post(gateway.address + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60.0)
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return reply.status_code, [reply.json()]
    events = [e for e in reply.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", events
    return reply.status_code, [json.loads(e[len("data: "):]) for e in events[:-1]]


CHAT = {"messages": [{"role": "user", "content": "Which bread keeps longest?"}], "max_tokens": 4, "temperature": 0}
TEXT = {"prompt": "Rye, spelt and", "max_tokens": 4, "temperature": 0}
SHAPES = [
    ("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1, "seed": 5}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "return_token_ids": True}),
    ("/v1/completions", TEXT), ("/v1/completions", {**TEXT, "prompt": [5, 17, 42], "n": 2}),
    ("/v1/completions", {**TEXT, "stream": True}),
    ("/v1/completions", {**TEXT, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}),
]


@pytest.mark.parametrize("path, body", SHAPES)
def test_every_reply_and_chunk_is_in_openais_schema(gateway, model, path, body):
    status, bodies = post(gateway, path, {"model": model, **body})
    assert status == 200 and bodies, bodies
    for reply in bodies:
        check_body(reply, streamed=bool(body.get("stream")))
    if path == "/v1/chat/completions" and not body.get("stream"):
        assert all(c["message"]["refusal"] is None for c in bodies[0]["choices"])
    if "stream_options" in body:
        assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 4 * body.get("n", 1)


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", {"messages": []}, 400), ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
])
def test_errors_are_in_openais_schema(gateway, model, path, body, status):
    answer = post(gateway, path, {"model": model, **body})
    assert answer[0] == status
    check_error(answer[1][0])


def test_the_schema_check_refuses_what_openais_schema_does():
    """The check has teeth: each of these once left the gateway or could."""
    whole = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi", "refusal": None}, "logprobs": None,
         "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    check_body(whole)
    no_refusal = {**whole, "choices": [{**whole["choices"][0], "message": {"role": "assistant", "content": "Hi"}}]}
    for bad in (no_refusal, {**whole, "system_fingerprint": None}, {**whole, "created": "1"},
                {**whole, "surprise": 1}, {k: v for k, v in whole.items() if k != "created"}):
        with pytest.raises(Exception):
            check_body(bad)
    with pytest.raises(AssertionError):
        check_body({**whole, "object": "text_completion", "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})


@pytest.mark.parametrize("key, problem", [(None, "this request needs an API key"),
                                          ("not-" + KEY, "the cluster does not know this API key")])
def test_a_missing_or_unknown_key_is_told_to_send_the_http_header(gateway, model, key, problem):
    """The coordinators refuse in gRPC's words (the metadata `authorization`); an HTTP caller is
    told what to send over HTTP."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
    for method, path, data in (("POST", "/v1/completions", body), ("GET", "/v1/models", None)):
        status, _, answer = http(gateway.address, method, path, data, headers)
        error = json.loads(answer)["error"]
        assert status == 401 and error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert error["message"] == f"{problem}: send one the cluster knows in the header `Authorization: Bearer KEY`"
    if key:   # the openai client will not go without one
        with openai.OpenAI(base_url=gateway.address + "/v1", api_key=key, max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError) as refused:
                stranger.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert refused.value.body["message"].startswith(problem)
