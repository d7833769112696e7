"""The request bodies of /v1/completions and /v1/chat/completions as OpenAI's reference shapes
them (pydantic models), and what a valid one asks the cluster for (a Call).

Defaults are OpenAI's, not `kvcache generate`'s: temperature 1 (0 is greedy), max_tokens 16 for
completions; a chat without max_tokens gets DEFAULT_CHAT_MAX_TOKENS (OpenAI's "up to the context"
would tie every such request to the worker's limit). Unknown fields are ignored, as vLLM does;
fields we cannot honour (tools, best_of, suffix, penalties) are refused with a 400 that names them.
`prompt_cache_key`, else `user`, becomes the session id: the coordinators place by it, so one
user's requests meet the same kvnodes and worker.

Choices: a completion may carry several prompts (a list of strings or of token-id lists), and
each prompt gets `n` choices; every choice is a request to the cluster of its own, choice j of a
prompt seeded seed + j when a seed is given (else each sampled on its own; greedy ones are alike),
so a prompt among others gets what it gets alone. Choice index = prompt index x n + j, as OpenAI
numbers them.

Extensions vLLM also takes: `top_k` (0 or -1: no cut), `ignore_eos`, `return_token_ids` (each
streamed chunk carries the token ids of its text: a client can send a conversation back as token
ids, as the load bench does) and `stream_options.continuous_usage_stats` with `include_usage`
(every chunk carries the usage so far; the worker reports the prompt's tokens only at the end, so
the gateway counts them itself with the model's tokenizer, tokenizers.py, before it starts).

Logprobs (gateway/logprobs.py has their shapes): a chat's `logprobs: true` with `top_logprobs`
0..20 (OpenAI's bounds; top_logprobs without logprobs is refused, as OpenAI does); a completion's
`logprobs` 0..20 (OpenAI's legacy API stops at 5, vLLM at its --max-logprobs, 20 by default: one
bound serves the tools written against either) and `echo` (the prompt before the text; with
logprobs its tokens' logprobs first, computed by the worker over the whole prompt, no cached
prefix reused). `max_tokens: 0` is allowed with echo alone (the prompt's logprobs, as lm-eval's
loglikelihood requests may ask).

Types are JSON's, strictly (as OpenAI checks them, not as Python would convert them): "2" is not an
integer, 1 not a boolean, 2.0 not a token id; an integer is a float. Every list a client sends is
bounded (Bounded), its length checked before its items, and its items' checking stops at the first
wrong one: a 4 MiB list of wrong items costs no more than one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import ApiError, bad_request

MAX_LOGPROBS = 20  # the worker's bound too (worker/engine/logprobs.py)

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512
MAX_STOP = 4
MAX_CHOICES = 8           # n
MAX_PROMPTS = 64          # a completion's prompts; with n, at most MAX_REQUESTS choices in all
MAX_REQUESTS = 64         # requests to the cluster one call makes (each prompt's n choices)
MAX_SESSION_CHARS = 256
MAX_STOP_CHARS = 256      # the worker's bound on one stop string (worker/engine/sampling.py)
MAX_MESSAGES = 1024       # the worker's bound on a chat (worker/model/chat.py)
MAX_CONTENT_PARTS = 1024
MAX_TOKEN_IDS = 2**17     # a prompt's or /detokenize's ids: beyond any context served
_U32 = 2**32 - 1
_STRICT = ConfigDict(extra="ignore", strict=True)   # JSON's types, not Python's conversions


def Bounded(item, max_items: int):
    """A list of at most max_items, refused at the first wrong item."""
    return Annotated[list[item], Field(max_length=max_items, fail_fast=True)]


TokenId = Annotated[int, Field(ge=0, le=_U32)]
TokenIds = Bounded(TokenId, MAX_TOKEN_IDS)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, usage so far on every chunk


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, Bounded(TextPart, MAX_CONTENT_PARTS), None] = None


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]


class _Common(BaseModel):
    model_config = _STRICT
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, le=_U32)   # 0 only for a completion's echo
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=_U32)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                Bounded(Annotated[str, Field(max_length=MAX_STOP_CHARS)], MAX_STOP), None] = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    user: str | None = Field(None, max_length=MAX_SESSION_CHARS)
    prompt_cache_key: str | None = Field(None, max_length=MAX_SESSION_CHARS)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionRequest(_Common):
    prompt: Union[str, Bounded(str, MAX_PROMPTS), TokenIds, Bounded(TokenIds, MAX_PROMPTS)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Common):
    messages: Messages
    max_tokens: int | None = Field(None, ge=1, le=_U32)
    max_completion_tokens: int | None = Field(None, ge=1, le=_U32)
    tools: Bounded(object, MAX_CONTENT_PARTS) | None = None
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)


@dataclass
class Call:
    """What one request asks the cluster: generate(prompt, session_id, **options) for each choice."""

    model: str
    prompts: list                       # each a text, token ids or chat messages (a chat has one)
    session_id: str
    options: dict = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False      # usage so far on every chunk
    return_token_ids: bool = False
    n: int = 1                          # choices of each prompt
    logprobs: int | None = None         # the top-k count of each token's logprobs; None: no logprobs
    echo: bool = False                  # a completion's prompt before its text
    echo_texts: list = field(default_factory=list)  # per prompt: its text to echo; None: the worker's reading of ids

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int):
        return self.prompts[choice // self.n]

    def echo_text_of(self, choice: int) -> str | None:
        return self.echo_texts[choice // self.n] if self.echo_texts else None

    def options_of(self, choice: int) -> dict:
        """Choice j of a prompt is seeded seed + j (a seeded prompt gets what it gets alone)."""
        seed = self.options["seed"]
        return {**self.options, "seed": None if seed is None else (seed + choice % self.n) % 2**64}


def parse_completion(body: object) -> Call:
    request = validate(CompletionRequest, body)
    refuse_if(request.best_of not in (None, 1), "best_of")
    refuse_if(request.suffix, "suffix")
    echo = bool(request.echo)
    if request.max_tokens == 0 and not echo:
        raise bad_request("max_tokens: 0 is only for echo (the prompt alone, with its logprobs); give at least 1",
                          param="max_tokens")
    prompts = _prompts(request.prompt)
    call = _call(request, prompts, DEFAULT_COMPLETION_MAX_TOKENS if request.max_tokens is None else request.max_tokens)
    call.logprobs, call.echo = request.logprobs, echo
    call.echo_texts = [prompt if echo and isinstance(prompt, str) else None for prompt in prompts]
    call.options.update(echo=echo, logprobs=request.logprobs,
                        prompt_logprobs=request.logprobs if echo else None)
    return call


def parse_chat(body: object) -> Call:
    request = validate(ChatRequest, body)
    refuse_if(request.tools, "tools")
    messages = chat_messages(request.messages)
    max_tokens = request.max_completion_tokens or request.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs")
    call = _call(request, [messages], max_tokens)
    if request.logprobs:
        call.logprobs = request.top_logprobs or 0
        call.options["logprobs"] = call.logprobs
    return call


def chat_messages(messages: list[Message]) -> list[dict]:
    """Messages as the worker takes them: a developer's are a system's, content parts joined."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)} for m in messages]


def validate(model: type[BaseModel], body: object) -> BaseModel:
    """The body as `model`, or a 400 that names the first field it gets wrong and what it got."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_kind(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _refusal(exc.errors()) from None


# A place in pydantic's error locations that names a union's member, not a field: "str", "list[int]",
# "constrained-str", "TextPart".
_MEMBER = re.compile(r"[\[\]-]|^(str|int|float|bool|none|list|dict|object)$|^[A-Z]")
# What a field of several shapes takes, said when a value is none of them (by the field's name).
_SHAPES = {
    "prompt": "text, a list of token ids (integers from 0 to 2**32 - 1), or a list of prompts "
              "(texts, or lists of token ids)",
    "stop": f"a string or a list of up to {MAX_STOP} strings, each of at most {MAX_STOP_CHARS} characters",
    "content": "a string, a list of text parts ({\"type\": \"text\", \"text\": ...}) or null",
}
_TYPE_ERRORS = ("int_type", "bool_type", "string_type", "float_type", "list_type", "model_type", "dict_type",
                "int_from_float", "model_attributes_type")


def _refusal(errors: list[dict]) -> ApiError:
    first = errors[0]
    member = next((i for i, part in enumerate(first["loc"]) if isinstance(part, str) and _MEMBER.search(part)), None)
    if member is None:
        param = _dotted(first["loc"])
        return bad_request(f"{param}: {_said(first)}" if param else _said(first), param=param or None)
    # None of a union's members took the value. The reason said is a member's that took its JSON type
    # and refused its value (too long, out of range), else how far the best member got and what it met.
    param = _dotted(first["loc"][:member])
    name = next((part for part in reversed(first["loc"][:member]) if isinstance(part, str)), "")
    group = [e for e in errors if tuple(e["loc"][:member]) == tuple(first["loc"][:member])]
    values = [e for e in group if e["type"] not in _TYPE_ERRORS]
    deepest = max(values or group, key=lambda e: (len(_fields(e["loc"])),
                                                  sum(p for p in e["loc"] if isinstance(p, int))))
    where = _dotted(deepest["loc"])
    if values:
        reason = f"{where}: {_said(deepest)}" if where != param else _said(deepest)
    else:
        reason = f"{where} is {json_kind(deepest['input'])}" if where != param else f"got {json_kind(deepest['input'])}"
    takes = _SHAPES.get(name)
    return bad_request(f"{param}: must be {takes} ({reason})" if takes else f"{param}: {reason}", param=param)


def _fields(loc) -> list:
    return [part for part in loc if not (isinstance(part, str) and _MEMBER.search(part))]


def _dotted(loc) -> str:
    return ".".join(str(part) for part in _fields(loc))


def _said(error: dict) -> str:
    if error["type"] == "too_long":
        return f"has {error['ctx']['actual_length']} items; at most {error['ctx']['max_length']}"
    if error["type"] == "too_short":
        return f"has {error['ctx']['actual_length']} items; at least {error['ctx']['min_length']}"
    if error["type"] in _TYPE_ERRORS:
        return f"{error['msg']}, got {json_kind(error['input'])}"
    return error["msg"]


def json_kind(value: object) -> str:
    """A value's JSON type, as a client wrote it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number written with a point" if value.is_integer() else "a number with a fraction"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _call(request: _Common, prompts: list, max_tokens: int) -> Call:
    refuse_if(request.presence_penalty, "presence_penalty")
    refuse_if(request.frequency_penalty, "frequency_penalty")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    if len(stop) > MAX_STOP or any(not s for s in stop):
        raise bad_request(f"stop: at most {MAX_STOP} non-empty strings, got {len(stop)}", param="stop")
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    options = dict(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=max(0, request.top_k or 0),
        seed=None if request.seed is None else request.seed % 2**64,   # OpenAI's seeds are signed
        stop=stop,
        ignore_eos=request.ignore_eos,
    )
    n = request.n or 1
    if len(prompts) * n > MAX_REQUESTS:
        raise bad_request(f"n: {len(prompts)} prompts of {n} choices each are {len(prompts) * n} requests; at most "
                          f"{MAX_REQUESTS} in one call: send fewer prompts or choices per call", param="n")
    return Call(model=request.model, prompts=prompts, session_id=request.prompt_cache_key or request.user or "",
                options=options, stream=bool(request.stream),
                include_usage=include_usage,
                continuous_usage=include_usage and request.stream_options.continuous_usage_stats,
                return_token_ids=request.return_token_ids, n=n)


def _prompts(prompt) -> list[str | list[int]]:
    """A completion's prompts: a text, token ids, or a list of either (several prompts)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt: is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    for i, p in enumerate(prompt):
        if not p and not isinstance(p, str):
            raise bad_request(f"prompt[{i}]: is an empty list of token ids", param="prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content)


def refuse_if(value, param: str, message: str | None = None) -> None:
    if value:
        raise ApiError(400, message or f"{param}: not supported by this server", param=param)
