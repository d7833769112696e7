"""One sequence as the scheduler and the engine see it: its tokens (prompt, then generated), its
blocks in the worker's pool, how many of its tokens are computed, and its page keys."""

from __future__ import annotations

import enum
from typing import Any, Sequence

from worker.kv.pages import page_keys
from worker.engine.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # parked while the connector fetches its pages
    FINISHED = "finished"


class Request:
    """One sequence: its tokens (prompt, then generated), its blocks, and what is computed."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                 root_key: bytes, page_tokens: int, tier_context: Any = None, bypass_cache: bool = False,
                 priority: int = 0):
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.tier_context = tier_context
        self.bypass_cache = bypass_cache
        self.priority = priority  # lower goes first, aging making it better as it waits (PriorityPolicy.priority)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # block i holds positions [iP, (i+1)P)
        self.num_cached_pages = 0  # leading pages of block_table that are indexed in the prefix cache
        self.num_released_blocks = 0  # leading entries a sliding window left behind (worker/kv/window.py)
        self.num_preemptions = 0
        self.arrival_step = 0  # the scheduler's step count when it was added (its age, for aging)
        self.remote_given_up = False  # its remote pages failed or came too late: it computes them (scheduler)
        self.cached_tokens_local: int | None = None  # set by the first admission
        self.cached_tokens_remote: int | None = None
        # Prompt logprobs (worker/engine/logprobs.py): entry p is token p + 1's, set as its chunk computes.
        self.prompt_logprobs: list | None = ([None] * (self.num_prompt_tokens - 1)
                                             if params.prompt_logprobs is not None else None)
        self.prompt_computed = False  # its whole prompt has been computed once (the engine sampled after it)
        self._root_key = root_key
        self._page_tokens = page_tokens
        self._page_keys: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def held_blocks(self) -> list[int]:
        """The blocks it holds a reference on: its table without the pages a window released."""
        return self.block_table[self.num_released_blocks:]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def wants_prompt_logits(self) -> bool:
        """It takes logits at every prompt position until its prompt is computed (its prompt logprobs)."""
        return self.prompt_logprobs is not None and not self.prompt_computed

    def num_reusable_pages(self) -> int:
        """Full pages of its tokens that a cache may supply: every one, the last too (Scheduler._admit
        still computes the last token), none when it bypasses the cache or wants its prompt's logits.

        A position whose K/V came from a cache has no logits, and recomputing the queries of cached
        positions would cost as much as computing them (and a forward mode of its own): so a request
        that wants its prompt's logprobs reuses no cached prefix, neither the worker's nor the
        kvnodes'. Its pages are still cached and written back, for the requests after it; once its
        prompt is computed it is a request as any other, and a preemption may reuse them."""
        return 0 if self.bypass_cache or self.wants_prompt_logits else self.num_tokens // self._page_tokens

    def page_keys(self, num_pages: int) -> list[bytes]:
        """Keys of the first `num_pages` full pages (computed once, extended as the sequence grows)."""
        if num_pages > len(self._page_keys):
            upto = self.token_ids[:num_pages * self._page_tokens]
            start = len(self._page_keys)
            parent = self._page_keys[-1] if start else None
            self._page_keys += page_keys(self._root_key, upto, self._page_tokens, start=start, parent_key=parent)
        return self._page_keys[:num_pages]
