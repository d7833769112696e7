"""vLLM's tokenizer routes, which lm-eval's remote tokenizer and load tools use to count and cut
prompts as the server does: POST /tokenize, POST /detokenize and GET /tokenizer_info, from the
models' tokenizers (tokenizers.py).

As vLLM's: at the root, not under /v1; `model` may be left out while the cluster serves one model
(lm-eval sends none; /tokenizer_info takes it as `?model=`); /tokenize takes {"prompt"} or
{"messages", "add_generation_prompt"} and answers {"count", "max_model_len", "tokens"}, special
tokens added to a prompt and not to a chat unless `add_special_tokens` says otherwise (the
worker's own defaults, so the count is usage's prompt_tokens); /detokenize answers {"prompt"}.
Like every route they want a key the coordinators know in front of a secure cluster."""

from __future__ import annotations

from typing import Awaitable, Callable

import anyio
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.errors import ApiError, bad_request
from gateway.shapes import _STRICT, Messages, TokenIds, chat_messages, refuse_if, validate
from gateway.tokenizers import MAX_PROMPT_CHARS_PER_TOKEN, Tokenizers
from gateway.upstream import Upstream


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = Field(None, min_length=1)
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    tools: list | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = Field(None, min_length=1)
    tokens: TokenIds


def tokenizer_routes(upstream: Upstream, tokenizers: Tokenizers, read_body: Callable[[Request], Awaitable[object]],
                     key_of: Callable[[Request], str | None]) -> list[Route]:
    """`read_body`: the request's JSON, bounded as every body is; `key_of`: the caller's key."""

    async def model_of(request: Request, name: str | None):
        token = key_of(request)
        if name is None:
            name = await _only_model(upstream, token)
        await upstream.check_model(name, token)   # a model the cluster serves, for a key it knows
        return await tokenizers.get(name)

    async def tokenize(request: Request) -> Response:
        body = validate(TokenizeRequest, await read_body(request))
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send a prompt or messages, one of them")
        for param in ("continue_final_message", "return_token_strs", "chat_template", "tools"):
            refuse_if(getattr(body, param), param)
        model = await model_of(request, body.model)
        if body.prompt is not None:
            model.check_length(body.prompt, "prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            tokens = await anyio.to_thread.run_sync(model.encode, body.prompt, special)
        else:
            messages = chat_messages(body.messages)
            model.check_length(messages, "messages")
            tokens = await anyio.to_thread.run_sync(model.chat, messages, body.add_generation_prompt,
                                                    bool(body.add_special_tokens))
        return JSONResponse({"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens})

    async def detokenize(request: Request) -> Response:
        body = validate(DetokenizeRequest, await read_body(request))
        model = await model_of(request, body.model)
        return JSONResponse({"prompt": await anyio.to_thread.run_sync(model.decode, body.tokens)})

    async def tokenizer_info(request: Request) -> Response:
        name = request.query_params.get("model") or None
        return JSONResponse((await model_of(request, name)).info)

    return [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"]),
            Route("/tokenizer_info", tokenizer_info, methods=["GET"])]


async def _only_model(upstream: Upstream, token: str | None) -> str:
    models = await upstream.models(token=token) or await upstream.models(fresh=True, token=token)
    if len(models) == 1:
        return next(iter(models))
    if not models:
        raise ApiError(503, "no worker is serving: the cluster has no live worker", code="no_worker")
    raise bad_request(f"model: required while the cluster serves several: {', '.join(models)}", param="model")
