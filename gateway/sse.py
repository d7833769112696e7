"""Server-sent events of a streamed completion: one `data: {json}` event per chunk, the finish
reason, with include_usage a last chunk carrying usage, and `data: [DONE]`. With continuous usage
stats every chunk carries its choice's usage so far, as vLLM's do: the prompt's tokens (counted by
the gateway; a finish chunk has the worker's counts) and the tokens the choice has made."""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncIterator

from base.generation import Finished, Piece
from gateway.errors import ApiError
from gateway.logprobs import ChoiceText
from gateway.replies import Reply, combined, usage_so_far

log = logging.getLogger("gateway")

DONE = b"data: [DONE]\n\n"


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def stream(reply: Reply, count: int, first: tuple[int, Piece | Finished], events: AsyncIterator,
                 include_usage: bool, on_finish=None, token_ids: bool = False,
                 prompt_tokens: list[int] | None = None, choice_text=None, n: int = 1) -> AsyncIterator[bytes]:
    """The events of one response of `count` choices (n of each prompt); `events` gives (choice
    index, event) pairs. Leaving early (the client went away, or took nothing for the gateway's
    --send-timeout and was dropped) closes `events`, which cancels the requests on their workers,
    with one log line. `on_finish(finished)` runs as each choice's final event is sent.
    `prompt_tokens`: given (one count a choice), each chunk carries usage so far (continuous usage
    stats). `choice_text(i)`: choice i's ChoiceText (gateway/logprobs.py: its echo and logprobs),
    by default text alone."""
    texts = [(choice_text or (lambda _: ChoiceText(reply.chat, None)))(i) for i in range(count)]
    tokens = 0
    made = [0] * count   # tokens each choice has made so far
    finished: dict[int, Finished] = {}

    def so_far(i: int) -> dict | None:
        return None if prompt_tokens is None else usage_so_far(prompt_tokens[i], made[i])

    async with aclosing(events):
        index, current = first
        try:
            if reply.chat:
                for i in range(count):
                    yield event(reply.chunk(role=True, with_usage_field=include_usage, index=i, usage=so_far(i)))
            while True:
                if isinstance(current, Finished):
                    finished[index] = current
                    final = current.usage
                    yield event(reply.chunk(finish_reason=current.finish_reason, with_usage_field=include_usage,
                                            index=index, usage=None if prompt_tokens is None else
                                            usage_so_far(final.prompt_tokens, final.completion_tokens)))
                    if on_finish is not None:
                        on_finish(current)
                    if len(finished) == count:
                        if include_usage:
                            yield event(reply.usage_chunk(combined([finished[i].usage for i in range(count)], n)))
                        break
                else:
                    # Every token is sent as it comes, also one whose text is still empty (a character
                    # split across tokens): a client sees the first token when the worker makes it.
                    made[index] += len(current.token_ids)
                    text, logprobs = texts[index].piece(current)
                    yield event(reply.chunk(text, with_usage_field=include_usage, index=index,
                                            token_ids=current.token_ids if token_ids else None, usage=so_far(index),
                                            logprobs=logprobs))
                    tokens += 1
                index, current = await events.__anext__()
        except ApiError as exc:   # the status line is sent already: the error goes in the stream, as vLLM does
            yield event(exc.body())
        except (GeneratorExit, asyncio.CancelledError):   # closed while sending, or while waiting for a token
            if len(finished) < count:
                log.info("%s: the client went away or stopped reading after %d tokens: cancelled on its worker",
                         reply.id, tokens)
            raise
        yield DONE
