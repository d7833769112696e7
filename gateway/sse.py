"""Server-sent events of a streamed completion: one `data: {json}` event per chunk, the finish
reason, with include_usage a last chunk carrying usage, and `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator

from coordinator.client import Finished, Piece
from gateway.errors import ApiError
from gateway.replies import Reply

log = logging.getLogger("gateway")

DONE = b"data: [DONE]\n\n"


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def stream(reply: Reply, first: Piece | Finished, events: AsyncIterator, include_usage: bool,
                 on_finish=None, token_ids: bool = False) -> AsyncIterator[bytes]:
    """The events of one response; leaving early (the client went away, or took nothing for the
    gateway's --send-timeout and was dropped) closes `events`, which cancels the request on its
    worker, with one log line. `on_finish(finished)` runs once the final event is sent."""
    tokens = 0
    async with aclosing(events):
        current = first
        try:
            if reply.chat:
                yield event(reply.chunk(role=True, with_usage_field=include_usage))
            while True:
                if isinstance(current, Finished):
                    yield event(reply.chunk(finish_reason=current.finish_reason, with_usage_field=include_usage))
                    if include_usage:
                        yield event(reply.usage_chunk(current.usage))
                    if on_finish is not None:
                        on_finish(current)
                    break
                # Every token is sent as it comes, also one whose text is still empty (a character
                # split across tokens): a client sees the first token when the worker makes it.
                yield event(reply.chunk(current.text, with_usage_field=include_usage,
                                        token_ids=current.token_ids if token_ids else None))
                tokens += 1
                current = await events.__anext__()
        except ApiError as exc:   # the status line is sent already: the error goes in the stream, as vLLM does
            yield event(exc.body())
        except (GeneratorExit, asyncio.CancelledError):   # closed while sending, or while waiting for a token
            if not isinstance(current, Finished):
                log.info("%s: the client went away or stopped reading after %d tokens: cancelled on its worker",
                         reply.id, tokens)
            raise
        yield DONE
