"""The gateway's ASGI app (Starlette): OpenAI's routes over an Upstream.

Every answer that is not a success is OpenAI's error shape (errors.py), also for unknown routes
and methods; a 500 means a bug of ours, logged with its traceback, never a client's mistake."""

from __future__ import annotations

import logging
from contextlib import aclosing, asynccontextmanager
from typing import Awaitable, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from base.generation import Finished, Piece
from base.log_limits import CountedEvent
from gateway import sse
from gateway.bodies import CLIENT_GONE, read_json
from gateway.errors import ApiError
from gateway.logprobs import ChoiceText
from gateway.replies import Reply, combined, model_body
from gateway.shapes import Call, parse_chat, parse_completion
from gateway.tokenize import tokenizer_routes
from gateway.tokenizers import Tokenizers
from gateway.tracing import TraceRequests
from gateway.upstream import Upstream
from base.observability import tracing_enabled

log = logging.getLogger("gateway")


MAX_KEY_CHARS = 1024   # far beyond any key a tokens file holds; gRPC metadata has room for it


def bearer(request: Request) -> str | None:
    """The caller's key (`Authorization: Bearer KEY`), passed on to the coordinators, which check it
    (401 when they do not know it); None when there is none. A key that cannot be one (too long, not
    printable ASCII, as gRPC metadata must be) is a 401 here; two Authorization headers a 400."""
    headers = request.headers.getlist("authorization")
    if len(headers) > 1:
        raise ApiError(400, f"the request has {len(headers)} Authorization headers: send one, "
                            f"`Authorization: Bearer KEY`")
    scheme, _, key = (headers[0] if headers else "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    if len(key) > MAX_KEY_CHARS or not (key.isascii() and key.isprintable()):
        problem = f"has {len(key)} characters; at most {MAX_KEY_CHARS}" if len(key) > MAX_KEY_CHARS else \
            "has characters other than printable ASCII"
        raise ApiError(401, f"the API key {problem}: send one the cluster knows in the header "
                            f"`Authorization: Bearer KEY`", code="invalid_api_key")
    return key


def create_app(upstream: Upstream, max_body_bytes: int, body_timeout_s: float, on_startup: Callable[[], None] | None = None,
               metrics=None, metrics_need_key: bool = False, tokenizers: Tokenizers | None = None) -> Starlette:
    """`metrics_need_key`: /metrics wants a key the coordinators know, as every other route of a
    gateway in front of a secure cluster does (401 without one). `tokenizers`: the models' (for
    the tokenizer routes), by default those of presets and named models only."""
    tokenizers = tokenizers or Tokenizers()

    async def list_models(request: Request) -> Response:
        models = await upstream.models(token=bearer(request))
        return JSONResponse({"object": "list", "data": [model_body(n, t) for n, t in models.items()]})

    async def get_model(request: Request) -> Response:
        name, token = request.path_params["model"], bearer(request)
        await upstream.check_model(name, token)
        return JSONResponse(model_body(name, (await upstream.models(token=token))[name]))

    async def completions(request: Request) -> Response:
        return await _generate(request, parse_completion, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, parse_chat, chat=True)

    async def _generate(request: Request, parse: Callable[[object], Call], chat: bool) -> Response:
        token = bearer(request)
        call = parse(await read_json(request, max_body_bytes, body_timeout_s))
        await upstream.check_model(call.model, token)
        # The worker reports the prompt's tokens only at the end: with continuous usage the gateway
        # counts them itself, before the first chunk (a count per choice, of its prompt).
        prompt_tokens = None
        if call.continuous_usage:
            counts = [await tokenizers.prompt_tokens(call.model, prompt) for prompt in call.prompts]
            prompt_tokens = [counts[choice // call.n] for choice in range(call.choices)]
        reply = Reply(call.model, chat)
        events = upstream.choices(call, token)
        finished = metrics.finished if metrics is not None else None

        def choice_text(choice: int) -> ChoiceText:
            return ChoiceText(chat, call.logprobs, call.echo, call.echo_text_of(choice))

        if call.stream:
            first = await _unless_disconnected(request, events.__anext__)
            return StreamingResponse(sse.stream(reply, call.choices, first, events, call.include_usage, finished,
                                                call.return_token_ids, prompt_tokens, choice_text, call.n),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

        async def collect() -> tuple[list[ChoiceText], dict[int, Finished]]:
            texts, done = [choice_text(choice) for choice in range(call.choices)], {}
            async with aclosing(events):
                async for index, event in events:
                    if isinstance(event, Piece):
                        texts[index].piece(event)
                    else:
                        done[index] = event
                        if len(done) == call.choices:
                            return texts, done
            raise ApiError(503, "the cluster ended the stream without a final message")

        texts, done = await _unless_disconnected(request, collect)
        if finished is not None:
            for event in done.values():
                finished(event)
        wholes = [texts[i].whole() for i in range(call.choices)]
        choices = [(text, done[i].finish_reason, logprobs) for i, (text, logprobs) in enumerate(wholes)]
        return JSONResponse(reply.whole(choices, combined([done[i].usage for i in range(call.choices)], call.n)))

    async def health(request: Request) -> Response:
        token = bearer(request)
        try:
            models = await upstream.models(fresh=True, token=token)
        except ApiError as exc:
            if exc.status == 401:  # the coordinators answered: they want a key to say more
                return JSONResponse({"status": "ok", "models": [], "running": upstream.running})
            return JSONResponse({"status": "unavailable", "reason": exc.message}, status_code=503)
        if not models:
            return JSONResponse({"status": "unavailable", "reason": "no live worker"}, status_code=503)
        return JSONResponse({"status": "ok", "models": list(models), "running": upstream.running})

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        *tokenizer_routes(upstream, tokenizers, lambda request: read_json(request, max_body_bytes, body_timeout_s),
                          bearer),
    ]
    async def metrics_page(request: Request) -> Response:
        if metrics_need_key:
            await upstream.models(token=bearer(request))  # ApiError 401 for a key the coordinators refuse
        return await metrics.endpoint(request)

    if metrics is not None:
        routes.append(Route("/metrics", metrics_page, methods=["GET"]))
    middleware = metrics.middleware() if metrics is not None else []
    if tracing_enabled():
        middleware = [Middleware(TraceRequests), *middleware]   # outermost: the span covers the metrics too
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _bug},
        lifespan=_lifespan(upstream, on_startup),
    )


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable]):
    """work()'s result, or ApiError(499) as soon as the client hangs up (work is cancelled: the
    request ends on its worker)."""
    result, error, gone = None, None, False
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            group.cancel_scope.cancel()

        async def run() -> None:
            nonlocal result, error
            try:
                result = await work()
            except Exception as exc:   # raised below, not wrapped in the task group's ExceptionGroup
                error = exc
            group.cancel_scope.cancel()

        group.start_soon(watch)
        group.start_soon(run)
    if error is not None:
        raise error
    if gone:
        raise ApiError(CLIENT_GONE, "the client closed the request")
    return result


async def _api_error(request: Request, exc: ApiError) -> Response:
    if exc.status >= 500:
        log.info("%s %s: %d %s", request.method, request.url.path, exc.status, exc.message)
    return exc.response()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return ApiError(exc.status_code, message.get(exc.status_code, str(exc.detail))).response()


_BUGS = CountedEvent()   # a failure one request can make, many can make: one traceback per interval


async def _bug(request: Request, exc: Exception) -> Response:
    _BUGS.happened()
    if count := _BUGS.to_log():
        log.exception("%s %s failed (%d failure(s) since the last such line)", request.method, request.url.path, count)
    return ApiError(500, "the gateway failed on this request (a bug: see its log)").response()


def _lifespan(upstream: Upstream, on_startup):
    @asynccontextmanager
    async def lifespan(app):
        await upstream.open()   # on the loop that serves: grpc.aio's channels belong to it
        try:
            if on_startup is not None:
                on_startup()
            yield
        finally:
            await upstream.close()

    return lifespan
