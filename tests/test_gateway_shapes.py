"""The gateway's request shapes without a network: OpenAI's defaults, the forms a prompt may take,
and what is refused with a 400 that names the parameter."""

import pytest

from gateway.errors import ApiError
from gateway.shapes import (DEFAULT_CHAT_MAX_TOKENS, DEFAULT_COMPLETION_MAX_TOKENS, MAX_CHOICES, MAX_PROMPTS,
                            parse_chat, parse_completion)


def test_openai_defaults():
    call = parse_completion({"model": "m", "prompt": "Hi"})
    assert call.options["max_tokens"] == DEFAULT_COMPLETION_MAX_TOKENS and call.options["temperature"] == 1.0
    assert call.options["top_p"] == 1.0 and call.options["seed"] is None and not call.stream
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.options["max_tokens"] == DEFAULT_CHAT_MAX_TOKENS


def test_prompt_forms_and_chat_content():
    assert parse_completion({"model": "m", "prompt": "Hi"}).prompts == ["Hi"]
    assert parse_completion({"model": "m", "prompt": ["Hi"]}).prompts == ["Hi"]
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"model": "m", "prompt": [[4, 5]]}).prompts == [[4, 5]]
    assert parse_completion({"model": "m", "prompt": ["Hi", "there"]}).prompts == ["Hi", "there"]
    assert parse_completion({"model": "m", "prompt": [[4, 5], [6]]}).prompts == [[4, 5], [6]]
    chat = parse_chat({"model": "m", "max_completion_tokens": 7, "max_tokens": 9, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert chat.prompts == [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
                             {"role": "assistant", "content": ""}]]
    assert chat.options["max_tokens"] == 7


def test_session_stop_seed_and_stream_options():
    call = parse_completion({"model": "m", "prompt": "x", "user": "u1", "stop": "\n", "seed": -1, "stream": True,
                             "stream_options": {"include_usage": True}, "top_k": -1, "ignore_eos": True})
    assert call.session_id == "u1" and call.options["stop"] == ["\n"] and call.options["seed"] == 2**64 - 1
    assert call.stream and call.include_usage and call.options["top_k"] == 0 and call.options["ignore_eos"]
    assert parse_completion({"model": "m", "prompt": "x", "user": "u", "prompt_cache_key": "k"}).session_id == "k"


@pytest.mark.parametrize("extra, param", [
    ({"n": 9}, "n"), ({"n": 0}, "n"), ({"best_of": 2}, "best_of"), ({"suffix": "z"}, "suffix"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"logprobs": "2"}, "logprobs"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"stop": [""]}, "stop"), ({"user": "u" * 300}, "user"), ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"), ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": ["a"] * 9, "n": 8}, "n"),
    ({"prompt": [2**32]}, "prompt"), ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_refusals_name_the_parameter(extra, param):
    with pytest.raises(ApiError) as raised:
        parse_completion({"model": "m", "prompt": "x", **extra})
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


def test_n_choices_up_to_the_limit():
    assert parse_completion({"model": "m", "prompt": "x"}).n == 1
    assert parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": MAX_CHOICES}).n == MAX_CHOICES


def test_continuous_usage_stats_only_with_include_usage_as_vllm():
    def call(**options):
        return parse_completion({"model": "m", "prompt": "x", "stream": True, "stream_options": options})

    assert call(include_usage=True, continuous_usage_stats=True).continuous_usage
    assert not call(continuous_usage_stats=True).continuous_usage and not call(include_usage=True).continuous_usage


CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
    ({"max_tokens": 0}, "max_tokens"), ({"tools": [{}]}, "tools"),
])
def test_chat_refusals_name_the_parameter(extra, param):
    with pytest.raises(ApiError) as raised:
        parse_chat({**CHAT, **extra})
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


def test_logprobs_and_echo_ask_the_worker_for_them():
    chat = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 20})
    assert chat.logprobs == 20 and chat.options["logprobs"] == 20 and not chat.echo
    assert parse_chat({**CHAT, "logprobs": True}).logprobs == 0 and parse_chat(CHAT).logprobs is None
    plain = parse_completion({"model": "m", "prompt": "x", "logprobs": 0})
    assert plain.logprobs == 0 and plain.options["logprobs"] == 0 and plain.options["prompt_logprobs"] is None
    scored = parse_completion({"model": "m", "prompt": [[5, 6, 7]], "logprobs": 1, "echo": True, "max_tokens": 0})
    assert scored.options["max_tokens"] == 0 and scored.options["echo"] and scored.options["prompt_logprobs"] == 1
    assert scored.echo and scored.echo_texts == [None]   # token ids: the worker's reading of them is echoed
    echoed = parse_completion({"model": "m", "prompt": "Rye", "echo": True})
    assert echoed.echo_texts == ["Rye"] and echoed.logprobs is None and echoed.options["prompt_logprobs"] is None
    both = parse_completion({"model": "m", "prompt": ["Rye", "Oat"], "echo": True})
    assert both.echo_texts == ["Rye", "Oat"]


def test_each_prompts_choices_are_numbered_after_the_prompts_before_and_seeded_as_alone():
    call = parse_completion({"model": "m", "prompt": ["a", "b", "c"], "n": 2, "seed": 10})
    assert call.choices == 6
    assert [call.prompt_of(i) for i in range(6)] == ["a", "a", "b", "b", "c", "c"]
    assert [call.options_of(i)["seed"] for i in range(6)] == [10, 11, 10, 11, 10, 11]
    alone = parse_completion({"model": "m", "prompt": "b", "n": 2, "seed": 10})
    assert [alone.options_of(i) for i in range(2)] == [call.options_of(2), call.options_of(3)]
    assert parse_completion({"model": "m", "prompt": ["a"] * MAX_PROMPTS}).choices == MAX_PROMPTS
