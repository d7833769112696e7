"""The cluster as the gateway sees it: the coordinators through coordinator.aio_client.AsyncClient,
and nothing else. Its calls run on the gateway's own event loop (grpc.aio): a request's tokens go
from the gRPC stream to the HTTP response with no thread between them.

Models are the names the live workers registered (ClusterStatus), asked again at most every
MODELS_TTL_S seconds, and at once for a name not seen yet (a worker that just joined). At most
`max_streams` requests run at once; one more is refused with 429 before anything is sent to the
cluster. A request whose client goes away is cancelled: leaving `events` early cancels its gRPC
call, the coordinator cancels the worker's, and the worker frees the request's blocks.

The caller's key (`Authorization: Bearer`) goes to the coordinators with each of its calls; they
check it, so the gateway keeps no tokens file. Models are cached per key (a bounded number of
keys), so a caller without a valid key never sees another's answer. The client is made by
`open()` on the running loop (grpc.aio's channels belong to one loop), from the gateway's startup,
and closed by `close()` at its shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

from base.generation import Finished, Piece
from base.log_limits import CountedEvent
from coordinator.aio_client import AsyncClient, ClusterError
from coordinator.client import TlsMismatch
from gateway.errors import ApiError, bad_request, from_cluster, shown
from gateway.shapes import Call

log = logging.getLogger("gateway")

MODELS_TTL_S = 2.0
MODELS_CACHED_KEYS = 256
STATUS_TIMEOUT_S = 5.0


class Upstream:
    def __init__(self, open_client: Callable[[], AsyncClient], max_streams: int):
        self._open_client = open_client
        self.client: AsyncClient | None = None
        self.max_streams = max_streams
        self.running = 0
        self._first_seen: dict[str, int] = {}                  # model name -> first seen (unix seconds)
        self._models: OrderedDict[str | None, tuple[float, dict[str, int]]] = OrderedDict()  # by key
        self.started = int(time.time())
        self._mismatches = CountedEvent()  # a TLS mismatch with the coordinators (security.tls_mismatch)

    async def open(self) -> None:
        self.client = self._open_client()

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def models(self, fresh: bool = False, token: str | None = None) -> dict[str, int]:
        cached = self._models.get(token)
        if fresh or cached is None or time.monotonic() - cached[0] > MODELS_TTL_S:
            status = await self._refusals(self.client.status(STATUS_TIMEOUT_S, token), token)
            now = int(time.time())
            names = {m.model for m in status.members if m.role == "worker" and m.alive and m.model}
            for name in names:
                self._first_seen.setdefault(name, now)
            cached = self._models[token] = (time.monotonic(), {name: self._first_seen[name] for name in sorted(names)})
            self._models.move_to_end(token)
            while len(self._models) > MODELS_CACHED_KEYS:
                self._models.popitem(last=False)
        return cached[1]

    async def check_model(self, name: str, token: str | None = None) -> None:
        models = await self.models(token=token)
        if name not in models:
            models = await self.models(fresh=True, token=token)
        if not models:
            raise ApiError(503, "no worker is serving: the cluster has no live worker", code="no_worker")
        if name not in models:
            raise ApiError(404, f"The model `{shown(name)}` does not exist; this cluster serves: {', '.join(models)}",
                           param="model", code="model_not_found")

    def choices(self, call: Call, token: str | None = None) -> AsyncIterator[tuple[int, Piece | Finished]]:
        """(choice index, event) of each of the call's choices, as they come; one request to the
        cluster per choice (Call.options_of: its seed)."""
        if call.choices == 1:
            return _numbered(self.events(call, 0, token))
        if call.choices > self.max_streams:   # never served, however long one waits
            raise bad_request(f"n: {call.choices} choices are as many requests, and this gateway runs at most "
                              f"{self.max_streams} at once (--max-streams): send fewer prompts or choices per call",
                              param="n")
        if self.running + call.choices > self.max_streams:
            raise ApiError(429, f"the gateway is serving {self.running} of its limit of {self.max_streams} requests; "
                                f"{call.choices} choices need as many: retry shortly", code="too_many_requests")
        return _merged([self.events(call, choice, token) for choice in range(call.choices)])

    async def events(self, call: Call, choice: int = 0, token: str | None = None) -> AsyncIterator[Piece | Finished]:
        """Choice `choice`'s events; ApiError for a refusal. Leaving the loop early cancels the request."""
        if self.running >= self.max_streams:
            raise ApiError(429, f"the gateway is serving its limit of {self.max_streams} requests: retry shortly",
                           code="too_many_requests")
        self.running += 1
        prompt = call.prompt_of(choice)
        try:
            stream = self.client.generate(prompt, session_id=call.session_id, token=token, **call.options_of(choice))
            async with aclosing(stream):
                while True:
                    event = await self._refusals(anext(stream, None), token)
                    if event is None:
                        raise ApiError(503, "the cluster ended the stream without a final message")
                    yield event
                    if isinstance(event, Finished):
                        return
        except ValueError as exc:   # generate_request refuses what protobuf cannot hold
            raise ApiError(400, str(exc), param=_param_of(str(exc), prompt)) from None
        except ApiError as exc:
            if exc.status == 400 and exc.param is None:
                exc.param = _param_of(exc.message, prompt)
            raise
        finally:
            self.running -= 1   # leaving early closed the stream, which cancelled the call on its worker

    async def _refusals(self, pending: Awaitable, token: str | None):
        """pending's result, the cluster's refusals as ApiErrors (`token`: the caller's key, if any)."""
        try:
            return await pending
        except ClusterError as exc:
            if isinstance(exc, TlsMismatch):  # the operator's to fix: said in the log too
                self._mismatches.happened()
                if count := self._mismatches.to_log():
                    log.warning("%d request(s) failed since the last such line: %s", count, exc.details)
            raise from_cluster(exc.code, exc.details, key_sent=token is not None) from None


# The worker's refusals (worker/service.py, worker/engine) by their first words -> the field at fault.
_PARAMS = (("max_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
           ("the chat", "messages"), ("at most 16 stop strings", "stop"), ("stop", "stop"), ("token ids", "prompt"),
           ("the prompt", "prompt"), ("prompt", "prompt"))


def _param_of(message: str, prompt: object) -> str | None:
    """The request field a refusal of the cluster is about, when its message says it; a chat's
    prompt is its messages."""
    param = next((param for start, param in _PARAMS if message.startswith(start)), None)
    is_chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
    return "messages" if param == "prompt" and is_chat else param


async def _numbered(events: AsyncIterator) -> AsyncIterator[tuple[int, Piece | Finished]]:
    async with aclosing(events):
        async for event in events:
            yield 0, event


async def _merged(choices: list[AsyncIterator]) -> AsyncIterator[tuple[int, Piece | Finished]]:
    """(index, event) of several choices' events as they come, until each has finished. A choice
    that fails fails them all; leaving early cancels every one (each task closes its events)."""
    arrived: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events: AsyncIterator) -> None:
        try:
            async with aclosing(events):
                async for event in events:
                    await arrived.put((index, event, None))
        except Exception as exc:   # handed to the reader, raised there
            await arrived.put((index, None, exc))

    tasks = [asyncio.create_task(pump(i, events)) for i, events in enumerate(choices)]
    try:
        unfinished = len(tasks)
        while unfinished:
            index, event, error = await arrived.get()
            if error is not None:
                raise error
            yield index, event
            unfinished -= isinstance(event, Finished)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
