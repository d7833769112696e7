"""The gateway as evaluation and load tools expect OpenAI's API (and vLLM's additions to it) to
be, on a cluster that wants client keys (a tokens file): every kind of reply and streamed chunk
in OpenAI's published schema (openai_schema.py); vLLM's continuous usage stats; vLLM's
/tokenize, /detokenize and /tokenizer_info, used as lm-eval's remote tokenizer uses them, giving
the ids the worker makes; and a refusal for want of a key in HTTP's words. A real `kvcache
gateway` process, spoken to with the real `openai` client and plain HTTP (httpx2, which the
openai package is built on)."""

from __future__ import annotations

import json

import httpx2
import openai
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gguf_helpers import CHATML
from gateway_helpers import cluster_with_gateway, http, openai_client
from kvcache.launch import Daemon
from openai_schema import check_body, check_error

KEY = "gateway-tests-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


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
    reply = httpx2.post(gateway.address + path, json=body, headers=AUTH, timeout=60.0)
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return reply.status_code, [reply.json()]
    events = [e for e in reply.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", events
    return reply.status_code, [json.loads(e[len("data: "):]) for e in events[:-1]]


CHAT = {"messages": [{"role": "user", "content": "Which bread keeps longest?"}], "max_tokens": 4, "temperature": 0}
TEXT = {"prompt": "Rye, spelt and", "max_tokens": 4, "temperature": 0}
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
SHAPES = [
    ("/v1/chat/completions", CHAT), ("/v1/chat/completions", {**CHAT, "n": 2, "temperature": 1, "seed": 5}),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "n": 2}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "return_token_ids": True}),
    ("/v1/completions", TEXT), ("/v1/completions", {**TEXT, "prompt": [5, 17, 42], "n": 2}),
    ("/v1/completions", {**TEXT, "stream": True}),
    ("/v1/completions", {**TEXT, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": CONTINUOUS}),
    ("/v1/completions", {**TEXT, "stream": True, "stream_options": CONTINUOUS, "n": 2}),
    # logprobs: a chat's content items, a completion's four lists; with echo the prompt's first token null
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "stream": True, "n": 2, "temperature": 1, "seed": 3}),
    ("/v1/completions", {**TEXT, "logprobs": 2}), ("/v1/completions", {**TEXT, "logprobs": 0, "stream": True}),
    ("/v1/completions", {**TEXT, "logprobs": 5, "echo": True}),
    ("/v1/completions", {**TEXT, "prompt": [[5, 17, 42]], "logprobs": 1, "echo": True, "max_tokens": 0}),
    ("/v1/completions", {**TEXT, "logprobs": 1, "echo": True, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {**TEXT, "echo": True, "stream": True}),
    # several prompts: each prompt's n choices, numbered prompt x n + j
    ("/v1/completions", {**TEXT, "prompt": ["Rye, spelt and", "Oats"], "n": 2, "temperature": 1, "seed": 1}),
    ("/v1/completions", {**TEXT, "prompt": [[5, 17], [42]], "stream": True, "stream_options": CONTINUOUS}),
    ("/v1/completions", {**TEXT, "prompt": ["Rye", "Oats"], "logprobs": 1, "echo": True}),
]


def choices_of(body: dict) -> int:
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and not isinstance(prompt[0], int)
    return body.get("n", 1) * (len(prompt) if several else 1)


@pytest.mark.parametrize("path, body", SHAPES)
def test_every_reply_and_chunk_is_in_openais_schema(gateway, model, path, body):
    status, bodies = post(gateway, path, {"model": model, **body})
    assert status == 200 and bodies, bodies
    for reply in bodies:
        check_body(reply, streamed=bool(body.get("stream")))
    if path == "/v1/chat/completions" and not body.get("stream"):
        assert all(c["message"]["refusal"] is None for c in bodies[0]["choices"])
    if "stream_options" in body:
        assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 4 * choices_of(body)
    logprobs = [c["logprobs"] for b in bodies for c in b["choices"]]
    if body.get("logprobs") is None:
        assert logprobs == [None] * len(logprobs)
    elif path == "/v1/chat/completions":
        items = [item for lp in logprobs if lp for item in lp["content"]]
        assert len(items) == 4 * choices_of(body) and all(len(i["top_logprobs"]) == body.get("top_logprobs", 0)
                                                           for i in items)
    else:
        per_choice = [lp["token_logprobs"] for lp in logprobs if lp] if not body.get("stream") else \
            [[t for lp in logprobs if lp for t in lp["token_logprobs"]]]   # a stream's single choice
        for tokens in per_choice:
            assert (tokens[0] is None) == bool(body.get("echo"))
            assert len(tokens) > body["max_tokens"] if body.get("echo") else len(tokens) == body["max_tokens"]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", {"messages": []}, 400), ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
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
        check_body({**whole, "object": "text_completion",
                    "choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]})


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
                stranger.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=2)
        assert refused.value.body["message"].startswith(problem)


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(api, model):
    """vLLM's: the prompt's tokens (the gateway counts them; the worker agrees) and each choice's
    tokens so far, on every chunk; the last chunk has the whole usage, as with include_usage alone."""
    messages = [{"role": "user", "content": "Name a bread."}]
    chunks = list(api.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,
                                              stream=True, stream_options=CONTINUOUS, extra_body={"ignore_eos": True}))
    *streamed, last = chunks
    assert all(c.usage is not None for c in chunks) and last.choices == []
    assert last.usage.completion_tokens == 5 and last.usage.model_extra["kvcache"]["ttft_ms"] > 0
    assert {c.usage.prompt_tokens for c in chunks} == {last.usage.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    made = [c.usage.completion_tokens for c in streamed]
    assert made[0] == 0 and streamed[0].choices[0].delta.role == "assistant"
    assert made == sorted(made) and made[-1] == 5 and streamed[-1].choices[0].finish_reason == "length"


def test_continuous_usage_counts_each_choice_and_needs_include_usage(api, model):
    stream = api.completions.create(model=model, prompt=[5, 17, 42, 99], max_tokens=3, temperature=1, seed=2, n=2,
                                    stream=True, stream_options=CONTINUOUS, extra_body={"ignore_eos": True,
                                                                                        "return_token_ids": True})
    made = {0: 0, 1: 0}
    for chunk in stream:
        for choice in chunk.choices:
            made[choice.index] += len(choice.model_extra.get("token_ids") or [])   # none on a finish chunk
            assert chunk.usage.completion_tokens == made[choice.index] and chunk.usage.prompt_tokens == 4
    assert made == {0: 3, 1: 3} and chunk.usage.completion_tokens == 6   # the last chunk: both choices
    alone = list(api.completions.create(model=model, prompt="Rye", max_tokens=2, stream=True,
                                        stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)   # as vLLM: only with include_usage


def test_several_prompts_get_each_what_it_gets_alone_numbered_prompt_by_prompt(api, model):
    """OpenAI's batch of prompts: choice prompt x n + j is choice j of that prompt alone (the same
    seeds), whole or streamed; usage counts each prompt once and every choice's tokens."""
    prompts, same = ["Rye, spelt and", "Four loaves", "Oats"], dict(max_tokens=4, temperature=1, seed=9, n=2,
                                                                     extra_body={"ignore_eos": True})
    reply = api.completions.create(model=model, prompt=prompts, **same)
    alone = [api.completions.create(model=model, prompt=prompt, **same) for prompt in prompts]
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [c.text for a in alone for c in a.choices]
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 24
    texts, usages = [""] * 6, []
    for chunk in api.completions.create(model=model, prompt=prompts, stream=True,
                                        stream_options={"include_usage": True}, **same):
        usages += [chunk.usage] if chunk.usage else []
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in reply.choices] and [u.completion_tokens for u in usages] == [24]
    ids = api.completions.create(model=model, prompt=[[5, 17, 42], [7, 8]], max_tokens=3, temperature=0)
    assert [c.text for c in ids.choices] == [api.completions.create(model=model, prompt=p, max_tokens=3,
                                                                    temperature=0).choices[0].text
                                             for p in ([5, 17, 42], [7, 8])]
    echoed = api.completions.create(model=model, prompt=["Rye", "Oats"], max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("Rye") and echoed.choices[1].text.startswith("Oats")


def test_continuous_usage_of_text_needs_the_tokenizer_and_says_so(served, model, tmp_path):
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(served[0].coordinator_addresses)]
    with Daemon("gateway", args, log_path=tmp_path / "untold.log") as untold, openai_client(untold.address, KEY) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=model, prompt="Rye", max_tokens=2, stream=True, stream_options=CONTINUOUS)
        assert refused.value.body["param"] == "stream_options" and "--tokenizer" in refused.value.body["message"]
        ids = list(api.completions.create(model=model, prompt=[5, 17], max_tokens=2, stream=True,
                                          stream_options=CONTINUOUS))
        assert all(c.usage.prompt_tokens == 2 for c in ids)


def tokenize(gateway, **body) -> dict:
    status, [answer] = post(gateway, "/tokenize", body)
    assert status == 200, answer
    assert answer.keys() == {"count", "max_model_len", "tokens"} and answer["count"] == len(answer["tokens"])
    return answer


def test_tokenize_gives_the_ids_the_worker_makes_of_a_prompt_and_a_chat(api, gateway, model):
    """Counted as usage counts, and the ids sent back as a prompt answer as the text or chat did."""
    text = "The bakery opens at seven and the first bread comes out at"
    ids = tokenize(gateway, model=model, prompt=text)
    assert ids["max_model_len"] == 4096
    reply = api.completions.create(model=model, prompt=text, max_tokens=6, temperature=0)
    assert reply.usage.prompt_tokens == ids["count"]
    again = api.completions.create(model=model, prompt=ids["tokens"], max_tokens=6, temperature=0)
    assert again.choices[0].text == reply.choices[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Any rye bread?"}]
    chat_ids = tokenize(gateway, messages=messages)["tokens"]   # no model: lm-eval sends none
    chat = api.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    assert chat.usage.prompt_tokens == len(chat_ids)
    as_prompt = api.completions.create(model=model, prompt=chat_ids, max_tokens=6, temperature=0)
    assert as_prompt.choices[0].text == chat.choices[0].message.content
    opened = tokenize(gateway, messages=messages, add_generation_prompt=False)["tokens"]
    assert chat_ids[:len(opened)] == opened and len(opened) < len(chat_ids)


def test_tokenizer_info_and_tokenize_as_lm_eval_uses_them(gateway):
    """lm-eval's remote tokenizer: GET /tokenizer_info (it wants `eos_token`), the eos id as the
    first token of its text, its own rendering of `chat_template`, and decode through /detokenize."""
    reply = httpx2.get(gateway.address + "/tokenizer_info", headers=AUTH, timeout=30.0)
    assert reply.status_code == 200
    info = reply.json()
    assert info == {"tokenizer_class": "HFTokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                    "model_max_length": 4096, "chat_template": CHATML}
    assert tokenize(gateway, prompt=info["eos_token"], add_special_tokens=False)["tokens"] == [2]   # eos_token_id 2
    messages = [{"role": "user", "content": "Is there bread left?"}]
    rendered = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        info["chat_template"]).render(messages=messages, add_generation_prompt=True)
    ids = tokenize(gateway, prompt=rendered, add_special_tokens=False)["tokens"]
    assert ids == tokenize(gateway, messages=messages)["tokens"]
    status, [answer] = post(gateway, "/detokenize", {"tokens": ids})
    assert status == 200 and answer == {"prompt": rendered.replace("<|im_start|>", "").replace("<|im_end|>", "")}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, None), ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "b"}]}, "messages.0.role"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"), ("/detokenize", {"tokens": [300]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenizer_requests_are_400_in_openais_shape(gateway, path, body, param):
    status, [answer] = post(gateway, path, body)
    assert status == 400, answer
    check_error(answer)
    assert answer["error"]["param"] == param


def test_a_model_whose_tokenizer_the_gateway_cannot_load_is_404(served, gateway, model, tmp_path):
    """Without --tokenizer the gateway cannot tell where "chat" (a GGUF file's stem) came from;
    a model the cluster does not serve is 404 before any tokenizer is looked for."""
    status, [answer] = post(gateway, "/tokenize", {"model": "no-such-model", "prompt": "a"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    args = ["--host", "127.0.0.1", "--port", "0", "--coordinators", ",".join(served[0].coordinator_addresses)]
    with Daemon("gateway", args, log_path=tmp_path / "untold.log") as untold:
        for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/tokenizer_info", None)):
            reply = httpx2.request(method, untold.address + path, json=body, headers=AUTH, timeout=30.0)
            assert reply.status_code == 404, reply.text
            check_error(reply.json())
            error = reply.json()["error"]
            assert error["code"] == "model_not_found" and "--tokenizer" in error["message"]
        assert httpx2.post(untold.address + "/tokenize", json={"prompt": "a"}, timeout=30.0).status_code == 401
