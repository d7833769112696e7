"""The gateway against careless and hostile request bodies and headers: wrong JSON types, missing, huge or
malformed values, lone surrogates, NaN, odd keys, unknown models; each a cheap refusal in OpenAI's shape."""

from __future__ import annotations

import json
import time

import pytest

from gateway_helpers import http
from gateway_hostile_helpers import CHAT, post, raw, refused
from gateway_hostile_helpers import gateway, model, served  # noqa: F401 - fixtures, asked for by name

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

