"""OpenAI's published response schemas as a check on the gateway's bodies: CreateChatCompletionResponse,
CreateChatCompletionStreamResponse, CreateCompletionResponse (whole and streamed), the model list
and ErrorResponse.

The openai package's pydantic types (openai.types.chat.ChatCompletion, ...) are generated from the
OpenAPI spec, but they give every property a default, so a body without a required one passes
them. This adds what they leave out, written from the spec (openai/openai-openapi; no copy of it
can be fetched here): its required properties (present, even when null), the optional ones that
may not be null (left out, never null), and no property it does not have but our own, listed.
The types are used in strict mode (no coercion: a number sent as a string fails).

CheckedTransport puts the check under a real openai client: every reply, and every streamed event
as it arrives, of the routes it knows. It is an httpx2 transport: the openai package here is
built on httpx2 (httpx's successor), not httpx."""

from __future__ import annotations

import json

import httpx2
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

_TOP = {"id", "object", "created", "model", "choices"}
# A chat's logprobs (ChatCompletionTokenLogprob and its top_logprobs' items), whole or streamed.
_CHAT_LOGPROBS = {("choices", "logprobs"): {"content", "refusal"},
                  ("choices", "logprobs", "content"): {"token", "logprob", "bytes", "top_logprobs"},
                  ("choices", "logprobs", "content", "top_logprobs"): {"token", "logprob", "bytes"}}
# object -> {path to a part of the body: its required properties}. A path's list steps go into every item.
REQUIRED = {
    "chat.completion": {(): _TOP, ("choices",): {"index", "message", "finish_reason", "logprobs"},
                        ("choices", "message"): {"role", "content", "refusal"}, **_CHAT_LOGPROBS},
    "chat.completion.chunk": {(): _TOP, ("choices",): {"index", "delta", "finish_reason"}, **_CHAT_LOGPROBS},
    "text_completion": {(): _TOP, ("choices",): {"index", "text", "logprobs", "finish_reason"}},
}
# Ours beyond the spec's required: a completion's logprobs list these four without requiring any; we
# always send them all, one entry per token each, as OpenAI and vLLM do.
COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
USAGE_REQUIRED = {"prompt_tokens", "completion_tokens", "total_tokens"}
ERROR_REQUIRED = {"message", "type", "param", "code"}
# Optional and not nullable: absent or a value. A chat chunk's usage is nullable (null until the
# last chunk while include_usage is on); a completion's is not.
NOT_NULL = {"chat.completion": {"system_fingerprint", "service_tier", "usage"},
            "chat.completion.chunk": {"system_fingerprint", "service_tier"},
            "text_completion": {"system_fingerprint", "usage"}}
# (the part it is in, property): ours beside OpenAI's, documented in gateway/replies.py and shapes.py.
EXTENSIONS = {("usage", "kvcache"), ("choices", "token_ids")}
TYPES = {"chat.completion": ChatCompletion, "chat.completion.chunk": ChatCompletionChunk,
         "text_completion": Completion}


def check_body(body: dict, streamed: bool = False) -> BaseModel:
    """AssertionError naming what in `body` breaks the schema; else the parsed body."""
    kind = body.get("object")
    assert kind in TYPES, f"object {kind!r} is not one of {sorted(TYPES)}: {body}"
    if streamed:
        assert kind != "chat.completion", f"a streamed chunk of a chat is a chat.completion.chunk: {body}"
    else:
        assert kind != "chat.completion.chunk", f"a whole reply is not a chunk: {body}"
    for path, required in REQUIRED[kind].items():
        for part in _parts(body, path):
            missing = required - part.keys()
            where = ".".join(path) or "the body"
            assert not missing, f"{where} lacks {sorted(missing)}, which the spec requires: {body}"
    if isinstance(body.get("usage"), dict):
        assert USAGE_REQUIRED <= body["usage"].keys(), f"usage lacks {sorted(USAGE_REQUIRED - body['usage'].keys())}"
    nulls = sorted(name for name in NOT_NULL[kind] if name in body and body[name] is None)
    assert not nulls, f"{nulls} may be left out but not null: {body}"
    if kind == "text_completion" and streamed:
        # The spec's finish_reason has no null, yet OpenAI and vLLM stream null until a choice ends.
        body = {**body, "choices": [{**c, "finish_reason": c.get("finish_reason") or "stop"} for c in body["choices"]]}
    if kind == "text_completion":
        body = {**body, "choices": [{**c, "logprobs": _completion_logprobs(c["logprobs"], body)} for c in body["choices"]]}
    parsed = TYPES[kind].model_validate(body, strict=True)
    unknown = sorted(_extras(parsed) - EXTENSIONS)
    assert not unknown, f"properties the spec does not have: {unknown}: {body}"
    return parsed


def _completion_logprobs(logprobs: dict | None, body: dict) -> dict | None:
    """A completion choice's logprobs checked for what the spec leaves open (COMPLETION_LOGPROBS), and
    made fit for the spec's types: the spec's token_logprobs and top_logprobs items are a number and
    an object, yet OpenAI and vLLM give null for an echoed prompt's first token (nothing precedes it
    to predict it from): null there, at the first place only, passes."""
    if logprobs is None:
        return None
    assert logprobs.keys() == set(COMPLETION_LOGPROBS), f"a completion's logprobs are {COMPLETION_LOGPROBS}: {body}"
    lengths = {name: len(logprobs[name]) for name in COMPLETION_LOGPROBS}
    assert len(set(lengths.values())) == 1, f"a completion's logprobs have one entry per token each: {lengths}"
    nulls = [i for i, lp in enumerate(logprobs["token_logprobs"]) if lp is None]
    top_nulls = [i for i, top in enumerate(logprobs["top_logprobs"]) if top is None]
    assert nulls in ([], [0]) and top_nulls == nulls, (
        f"only an echoed prompt's first token has a null logprob (and null top logprobs): {body}")
    if not nulls:
        return logprobs
    return {**logprobs, "token_logprobs": [0.0, *logprobs["token_logprobs"][1:]],
            "top_logprobs": [{}, *logprobs["top_logprobs"][1:]]}


def check_error(body: dict) -> None:
    assert body.keys() == {"error"}, body
    assert body["error"].keys() == ERROR_REQUIRED, body
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


def check_models(body: dict) -> None:
    if "data" in body:
        assert body.keys() == {"object", "data"} and body["object"] == "list", body
        items = body["data"]
    else:
        items = [body]
    for item in items:
        assert item.keys() == {"id", "object", "created", "owned_by"}, item
        Model.model_validate(item, strict=True)


def _parts(body: dict, path: tuple) -> list[dict]:
    parts = [body]
    for step in path:
        nxt = []
        for part in parts:
            value = part.get(step)
            nxt.extend(value if isinstance(value, list) else [value] if isinstance(value, dict) else [])
        parts = nxt
    return parts


def _extras(model: BaseModel, parent: str = "") -> set[tuple[str, str]]:
    found = {(parent, name) for name in (model.model_extra or {})}
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                found |= _extras(item, name)
    return found


class CheckedTransport(httpx2.BaseTransport):
    """A transport for an openai client that checks every body of /completions,
    /chat/completions and /models it gets (a stream's events as they arrive): AssertionError on
    the first that breaks the schema. `checked` counts the bodies checked."""

    def __init__(self):
        self._inner = httpx2.HTTPTransport()
        self.checked = 0

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        path = request.url.path
        if path.endswith("/completions"):
            check = self._completion
        elif "/models" in path:
            check = self._models
        else:
            return response
        streamed = response.headers.get("content-type", "").startswith("text/event-stream")
        return httpx2.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                              stream=_Checked(response.stream, streamed, check))

    def _completion(self, body: dict, streamed: bool) -> None:
        check_error(body) if "error" in body else check_body(body, streamed)
        self.checked += 1

    def _models(self, body: dict, streamed: bool) -> None:
        check_error(body) if "error" in body else check_models(body)
        self.checked += 1

    def close(self) -> None:
        self._inner.close()


class _Checked(httpx2.SyncByteStream):
    def __init__(self, inner, streamed: bool, check):
        self._inner, self._streamed, self._check = inner, streamed, check

    def __iter__(self):
        pending = b""
        for chunk in self._inner:
            pending += chunk
            if self._streamed:
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    assert event.startswith(b"data: "), event
                    if event != b"data: [DONE]":
                        self._check(json.loads(event[len(b"data: "):]), True)
            yield chunk
        if not self._streamed and pending:
            self._check(json.loads(pending), False)

    def close(self) -> None:
        self._inner.close()
