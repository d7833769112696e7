"""Continuous batching over the block pool: which requests run in the next step, and with how
many new tokens each. Requests join and leave between steps.

Design notes
1. One rule for prefill and decode (vLLM v1): a request has `num_tokens` and
   `num_computed_tokens` (tokens whose K/V are in its blocks); each step it gets
   `min(num_tokens - num_computed_tokens, budget)` new tokens. A step that reaches
   `num_tokens` yields logits for the next token; a shorter one is a prefill chunk.
2. Decodes first: every running request with one token left is served each step, oldest
   first, so decoding is never starved (the budget holds one token per seat).
3. Then prefill, shortest first: of the running requests part-way through their prompt and
   the waiting ones, the one with the fewest tokens left to compute (for a waiting request,
   after its locally cached prefix, or the remote tier's hits once its lookup answered) gets at
   most `max_prefill_tokens`; other prompts join its step only if
   they finish within `join_tokens` more tokens. A request whose prompt is mostly cached thus
   starts at once instead of queueing behind long uncached prompts, and a long prompt is
   computed in chunks between them. Why one prompt a step: on a CPU a prefill token costs about
   the same in any batch, so a second prompt's chunk would delay the first one's first token by
   its whole cost, while a step of its own costs only the weights' pass (~45 ms against ~3 ms a
   token for gpt2-small-shape on one core); a few tokens that finish a prompt are the exception,
   cheaper to share than to wait for a step of their own. A request alone is chunked too: a
   request arriving during a 600-token prefill in one step waited 2.2 s for it, and chunks cost
   a lone prompt little (512 tokens: 2-4%) or even saved time (1,000 tokens: 3.1 s in 128-token
   chunks, 3.9 s in one step, on gpt2-small-shape).
   Aging bounds the wait: a request that has waited through `aging_steps` steps goes before
   every younger one (oldest first), so a long prompt is never starved by a stream of short
   ones.
4. When a request needs a block and none is available, the newest running request not yet in
   this step is preempted: its blocks are released (its full pages stay in the prefix cache),
   its tokens so far are kept, and it waits to be recomputed (keeping its age, so it soon goes
   first). A request alone always fits, because prompts and lengths are capped at the pool's size.
5. Admission reuses the longest locally cached prefix, then asks the KV connector
   (worker/connector.py) what the remote tier holds of the whole page chain (local hits
   included, so the tier learns which of our pages it lacks). While that lookup is in flight
   the request stays waiting and others go first. With remote pages past the local hits, the
   request gets blocks for them and is parked (WAITING_FOR_REMOTE_KVS) while the connector
   fetches them off the engine's thread: not scheduled, not preempted, holding a seat. In the
   first step after its load ended it joins as a running request, what landed counted as
   computed; whatever the tier did not fill is computed. Every full page of the prompt may be
   reused, the last one too; at least one prompt token is always computed (its logits give the
   next token), so a prompt whose every page is cached computes its last token alone, reading
   its K/V from the cached page and writing nothing there (ForwardBatch.cached_lens), instead of
   recomputing its whole last page.
   A tier that fails counts as a miss; a load the connector reports overdue is given up (its
   blocks released once the loader lets go of them) and the request computes its prompt.
   No network call is made here: the connector only submits and reports.
6. Each page that becomes full is indexed in the prefix cache and announced to the tier.
7. A request that arrives while a step computes a prompt's chunk may go between two layers of
   that step (the engine pauses the forward and asks `schedule_newcomer`): if all it has left
   to compute is shorter than the chunk, it would have been the step's prompt had it come a
   moment earlier (note 3), and waiting for the rest of the chunk (up to ~400 ms for 128
   tokens of gpt2-small-shape) would be most of its time to first token. It is admitted alone
   and computed whole; nothing is preempted for it, nor is anyone admitted in a step that
   preempted or found the pool short (the rules of note 4 and of `schedule`), and a step whose
   prompt was chosen by aging is never paused, so aging still bounds a long prompt's wait in
   steps (a step now lasts longer by the newcomers it carries, at most one per layer).
8. Priorities (lower values first, default 0): the prefill order of note 3 ranks by priority
   before tokens left (aged requests still go first), and preemption (note 4) takes the running
   request of the highest value, the newest among equals, so a request is never preempted for
   one of lower priority. Before a step takes its decodes, the first waiting request in that
   order, if it lacks a seat or the blocks of its first chunk, preempts running requests of a
   strictly higher value, one at a time, until it has them; it is then admitted in that step. Aging:
   a request's priority counts one better for every `aging_steps + 1` steps since it arrived,
   so a low-priority one cannot be preempted forever, and with equal priorities the order is
   exactly that of notes 3 and 4.
9. Sliding windows (worker/window.py): after each step a running request releases the blocks
   no later query of its window reads, once its full pages are cached and copied for the
   tier, so it holds at most about W / page_tokens + 1 blocks however long it grows.
10. Layer-wise overlap (issue 19, connector design note 7): a parked request whose layer-wise
   load is under way may join before the load ends, in a step of its own
   (`ScheduledBatch.layerwise`), so other requests never share a step with a wait on the
   network; the engine's forward waits (briefly) for each layer of its pages. Its remote pages
   count as computed from that step on, and they are indexed only in `settle_layerwise`, after
   the forward, once every page arrived intact; otherwise the step's work is thrown away: its
   blocks are released (those the loader may still write once it let go of them; the leading
   pages that arrived whole and intact, before an altered one, are cached first), and it waits
   to compute its prompt reusing only those, its usage then saying so.
   A layer that is late cuts the forward short and sends the request back to the parked ones
   (`repark`), to join when its load ended as any. A step that finds no blocks for its first
   chunk leaves it parked.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from worker.block_pool import BlockPool
from worker.connector import KVConnector
from worker.request import Request, RequestStatus
from worker.window import release_passed_blocks

log = logging.getLogger(__name__)


class RemoteTier(Protocol):
    """A second cache level behind the local prefix cache (issue 4 plugs in kvnodes); the
    engine wraps it in a KVConnector, which calls `lookup` and `fill` on threads of its own.

    `context` is the request's opaque `tier_context` (e.g. its placement). The tier reads and
    writes the engine's pool array, `engine.kv_pool[block_id]`, in the page layout and the KV dtype.
    """

    def lookup(self, keys: Sequence[bytes], context: Any) -> int:
        """How many of these page keys (the request's reusable chain, from its first page) do you hold?"""

    def fill(self, keys: Sequence[bytes], block_ids: Sequence[int], context: Any) -> int:
        """Write page keys[i] into block block_ids[i], in order; return how many were really filled."""

    def on_page_full(self, key: bytes, parent_key: bytes, block_id: int, context: Any) -> None:
        """A page became full (parent_key is b"" for a first page). Must not block; the block may be
        reused once this returns, so copy what you need now."""


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    admission_held: bool = False  # scheduling it preempted or found the pool short: admit nobody more
    layerwise: bool = False  # one request whose remote pages are still landing, layer by layer (note 10)

    def __len__(self) -> int:
        return len(self.requests)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


PREFILL_TOKENS_PER_STEP = 128  # prompt tokens per step at most: bounds the wait of a newly arrived prompt
AGING_STEPS = 64                # steps waited after which a request goes before every younger one
JOIN_TOKENS = 16                # tokens other prompts may add to a step's prefill if they finish in it

_LOOKUP_PENDING = -1  # _admit: the connector's lookup has not answered yet
_PARKED = -2          # _admit: blocks given, remote pages on their way (design note 5)


class Scheduler:
    def __init__(self, pool: BlockPool, page_tokens: int, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 1024, connector: KVConnector | None = None,
                 max_prefill_tokens: int = PREFILL_TOKENS_PER_STEP, aging_steps: int = AGING_STEPS,
                 join_tokens: int = JOIN_TOKENS, release_window: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({max_num_seqs}), so every running request can decode each step")
        if max_prefill_tokens < 1 or aging_steps < 0 or join_tokens < 0:
            raise ValueError(f"max_prefill_tokens must be at least 1, aging_steps and join_tokens at least 0, "
                             f"got {max_prefill_tokens}, {aging_steps} and {join_tokens}")
        self.pool = pool
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.aging_steps = aging_steps
        self.join_tokens = join_tokens
        self.connector = connector
        self.release_window = release_window  # design note 9; None keeps every page to the end
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order, oldest first
        self.parked: list[Request] = []  # waiting for remote KV (design note 5): blocks held, not scheduled
        self._remote_given_up: set[int] = set()  # ids of requests whose load was given up: they compute
        self._early: dict[int, tuple[int, int, bool]] = {}  # id -> (local hits, remote pages, usage set here): note 10
        self.num_layerwise_discarded = 0  # early-joined steps thrown away (note 10)
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, request: Request) -> None:
        max_blocks = self.pool.num_blocks
        if _cdiv(request.num_tokens, self.page_tokens) > max_blocks:
            raise ValueError(f"request {request.request_id} has {request.num_tokens} tokens; the pool holds "
                             f"at most {max_blocks * self.page_tokens} ({max_blocks} blocks of {self.page_tokens})")
        request.arrival_step = self.num_steps
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def num_seats_taken(self) -> int:
        return len(self.running) + len(self.parked)

    def schedule(self) -> ScheduledBatch:
        self.num_steps += 1
        self._take_finished_loads()
        early = self._join_early()
        if early is not None:
            return early
        self._preempt_for_priority()
        batch = ScheduledBatch([], [])
        preempted = False
        for request in [r for r in self.running if _tokens_left(r) == 1]:  # decodes (design note 2)
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older one
            preempted |= self._make_room(request, 1, batch)
            if request.status is RequestStatus.RUNNING:
                self._add_to_batch(batch, request, 1)
        budget = min(self.max_num_batched_tokens - sum(batch.num_new_tokens), self.max_prefill_tokens)
        pool_short = False
        joining = None  # once the step has its prefill: tokens that prompts finishing with it may add (note 3)
        for request, left in self._prefill_order(batch) if budget > 0 else []:  # design note 3
            if joining is not None and left > joining:
                continue
            limit = budget if joining is None else joining
            if request.status is RequestStatus.RUNNING:
                num_new = min(_tokens_left(request), limit)
                preempted |= self._make_room(request, num_new, batch)
                if request.status is not RequestStatus.RUNNING:
                    continue
                self._add_to_batch(batch, request, num_new)
            else:
                if preempted or pool_short or self.num_seats_taken() >= self.max_num_seqs:
                    continue  # no admission now; running requests later in the order may still compute
                num_new = self._admit(request, limit)
                if num_new == 0:
                    pool_short = True  # no request later in the order is admitted before this one
                    continue
                if num_new < 0:
                    continue  # its lookup is in flight, or it is parked while its pages arrive
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
            joining = min(self.join_tokens, budget - num_new) if joining is None else joining - num_new
            if joining <= 0:
                break
        assert batch.requests or not self.running, "requests are running but none could be scheduled"
        batch.admission_held = preempted or pool_short
        return batch

    def schedule_newcomer(self, step: ScheduledBatch) -> ScheduledBatch | None:
        """Between two layers of `step`'s forward: a waiting request to compute whole before the
        step goes on, or None (design note 7)."""
        chunk = max(step.num_new_tokens)
        if (chunk <= self.join_tokens or not self.waiting or self.num_seats_taken() >= self.max_num_seqs
                or step.admission_held or self._aged(step.requests[step.num_new_tokens.index(chunk)])):
            return None
        left, request = min(((self._tokens_to_compute(r), r) for r in self.waiting), key=lambda entry: entry[0])
        if left >= chunk:
            return None
        num_new = self._admit(request, left)
        if num_new <= 0:
            return None  # the pool cannot take it without preempting, or it waits for its remote pages
        self.waiting.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledBatch([request], [num_new])

    def on_computed(self, request: Request, num_new_tokens: int) -> None:
        """After the forward pass: the tokens are computed; index and announce pages that became
        full, then release those a sliding window left behind."""
        request.num_computed_tokens += num_new_tokens
        if not request.bypass_cache:
            self._cache_full_pages(request)
        if self.release_window is not None:  # after the write-back copied the pages (design note 9)
            release_passed_blocks(request, self.pool, self.release_window, self.page_tokens)

    def _cache_full_pages(self, request: Request) -> None:
        num_full = request.num_computed_tokens // self.page_tokens
        if num_full <= request.num_cached_pages:
            return
        keys = request.page_keys(num_full)
        for page in range(request.num_cached_pages, num_full):
            parent = keys[page - 1] if page else None
            block_id = self.pool.cache_full_block(request.block_table[page], keys[page], parent)
            request.block_table[page] = block_id
            if self.connector is not None:
                self.connector.on_page_full(keys[page], parent or b"", block_id, request.tier_context)
        request.num_cached_pages = num_full

    def settle_layerwise(self, request: Request) -> bool:
        """After an early-joined request's step (design note 10): True, its remote pages indexed,
        when every one arrived intact; else False, the step's work thrown away and the request
        waiting to compute its prompt without them."""
        num_hits, num_remote, set_usage = self._early.pop(id(request))
        remote = request.block_table[num_hits : num_hits + num_remote]
        filled = self.connector.settle_layerwise(request, remote)
        if filled == num_remote:
            keys = request.page_keys(num_hits + num_remote)
            for page in range(num_hits, num_hits + num_remote):
                parent = keys[page - 1] if page else None
                request.block_table[page] = self.pool.cache_full_block(request.block_table[page], keys[page], parent)
            request.num_cached_pages = num_hits + num_remote
            return True
        self.num_layerwise_discarded += 1
        log.info("remote pages of request %s did not all arrive intact (%s of %d); computing its prompt without "
                 "the others", request.request_id, "a load given up" if filled is None else filled, num_remote)
        if filled is None:  # the loader may still write them: released once it is done
            del request.block_table[num_hits : num_hits + num_remote]
        elif filled:  # whole and intact: cached, so the recompute reuses them
            keys = request.page_keys(num_hits + filled)
            for page in range(num_hits, num_hits + filled):
                parent = keys[page - 1] if page else None
                request.block_table[page] = self.pool.cache_full_block(request.block_table[page], keys[page], parent)
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        self._remote_given_up.add(id(request))
        if set_usage:  # what it will reuse: the local hits and the remote pages that were intact
            request.cached_tokens_local, request.cached_tokens_remote = (
                (num_hits * self.page_tokens, filled * self.page_tokens) if filled else (None, None))
        self.waiting.appendleft(request)
        return False

    def num_reused_tokens(self, request: Request) -> int:
        """Tokens whose K/V came from a cache into its blocks, never to be written again: its cached
        pages', and while it runs early (note 10) those of its remote pages still landing."""
        early = self._early.get(id(request))
        pages = early[0] + early[1] if early is not None else request.num_cached_pages
        return pages * self.page_tokens

    def repark(self, request: Request) -> None:
        """An early-joined request whose step was cut short by a late layer waits for its load again
        (design note 10): the blocks of its suffix go back, its remote ones stay the loader's."""
        num_hits, num_remote, set_usage = self._early.pop(id(request))
        self.pool.release(request.block_table[num_hits + num_remote :])
        del request.block_table[num_hits + num_remote :]
        request.num_computed_tokens = min(num_hits * self.page_tokens, request.num_tokens - 1)
        if set_usage:
            request.cached_tokens_local = request.cached_tokens_remote = None
        self.running.remove(request)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.parked.append(request)
        self.connector.unjoin(request)

    def finish(self, request: Request) -> None:
        """Remove a request (done or aborted) wherever it is and release its blocks at once."""
        early = self._early.pop(id(request), None)
        if early is not None:  # ended in its early-joined step (note 10): the loader may still write
            num_hits, num_remote, _ = early
            if self.connector.settle_layerwise(request, request.block_table[num_hits : num_hits + num_remote],
                                               wait_s=0.0) is None:
                del request.block_table[num_hits : num_hits + num_remote]
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.parked.remove(request)
            self.connector.give_up_load(request, request.block_table)  # released when the loader is done
            request.block_table = []
        self._release(request)
        if self.connector is not None:
            self.connector.forget(request)
        self._remote_given_up.discard(id(request))
        request.status = RequestStatus.FINISHED

    # ---- internals -----------------------------------------------------------

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        return max(0, _cdiv(request.num_computed_tokens + num_new, self.page_tokens) - len(request.block_table))

    def _can_grow(self, request: Request, num_new: int) -> bool:
        return self._blocks_needed(request, num_new) <= self.pool.get_num_free_blocks()

    def _grow(self, request: Request, num_new: int) -> None:
        request.block_table += self.pool.allocate(self._blocks_needed(request, num_new))

    def _release(self, request: Request) -> None:
        self.pool.release(request.held_blocks())
        request.block_table = []
        request.num_released_blocks = 0
        request.num_cached_pages = 0
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_room(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running requests outside the batch until `request` can grow (design
        note 4); it may be preempted itself. True if anything was preempted."""
        preempted = False
        while not self._can_grow(request, num_new):
            victim = self._victim(batch)
            self._preempt(victim)
            preempted = True
            if victim is request:
                break
        return preempted

    def _preempt_for_priority(self) -> None:
        """Before the step takes its decodes: if the first waiting request in the prefill order
        lacks a seat or blocks, preempt running requests of a higher priority value for it (note 8)."""
        if not self.waiting:
            return
        no_batch = ScheduledBatch([], [])
        request = next((r for r, _ in self._prefill_order(no_batch) if r.status is RequestStatus.WAITING), None)
        if request is None or (self.connector is not None and self.connector.is_looking_up(request)):
            return  # it could not be admitted now anyway
        P = self.page_tokens
        num_local = len(self.pool.lookup(request.page_keys(request.num_reusable_pages())))
        first_chunk_end = min(request.num_tokens, self._num_cached(request) + self.max_prefill_tokens)
        needed = _cdiv(first_chunk_end, P) - num_local
        while (self.num_seats_taken() >= self.max_num_seqs or needed > self.pool.get_num_free_blocks()):
            victim = self._lower_victim(request, no_batch)
            if victim is None:
                return
            self._preempt(victim)

    def _victim(self, batch: ScheduledBatch, exclude: Request | None = None) -> Request | None:
        """The running request outside the batch to preempt first: the highest priority value,
        the newest among equals (design notes 4 and 8)."""
        candidates = [(self._priority(r), i, r) for i, r in enumerate(self.running)
                      if r not in batch.requests and r is not exclude]
        return max(candidates, key=lambda entry: entry[:2])[2] if candidates else None

    def _lower_victim(self, request: Request, batch: ScheduledBatch) -> Request | None:
        """A running request that `request` may preempt: of a strictly higher priority value (note 8)."""
        victim = self._victim(batch, exclude=request)
        return victim if victim is not None and self._priority(victim) > self._priority(request) else None

    def _priority(self, request: Request) -> int:
        """Its priority, one better for every `aging_steps + 1` steps since it arrived (design note 8)."""
        return request.priority - (self.num_steps - request.arrival_step) // (self.aging_steps + 1)

    def _add_to_batch(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        self._grow(request, num_new)
        batch.requests.append(request)
        batch.num_new_tokens.append(num_new)

    def _prefill_order(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        """(request, prompt tokens it still has to compute) for running requests mid-prompt and
        waiting ones: aged ones first (oldest first), then by priority (note 8), then the fewest tokens left first;
        ties keep running before waiting, queue order."""
        candidates = [r for r in self.running if r not in batch.requests] + list(self.waiting)
        ranked = []
        for request in candidates:
            left = self._tokens_to_compute(request)
            rank = (0, request.arrival_step, 0) if self._aged(request) else (1, self._priority(request), left)
            ranked.append((rank, request, left))
        ranked.sort(key=lambda entry: entry[0])
        return [(request, left) for _, request, left in ranked]

    def _aged(self, request: Request) -> bool:
        """Waited through `aging_steps` steps: goes before every younger request (design note 3)."""
        return self.num_steps - request.arrival_step > self.aging_steps

    def _tokens_to_compute(self, request: Request) -> int:
        """Prompt tokens a request still has to compute (a waiting one: after its cached prefix)."""
        if request.status is RequestStatus.RUNNING:
            return _tokens_left(request)
        return request.num_tokens - self._num_cached(request)

    def _num_cached(self, request: Request) -> int:
        """Prompt tokens a waiting request would reuse from the local prefix cache now, or from
        the remote tier if its lookup answered with more (design note 3)."""
        if request.bypass_cache:
            return 0
        pages = len(self.pool.lookup(request.page_keys(request.num_reusable_pages())))
        if self.connector is not None and id(request) not in self._remote_given_up:
            pages = max(pages, self.connector.peek_matched_pages(request) or 0)
        return min(pages * self.page_tokens, request.num_tokens - 1)   # the last token is computed

    def _admit(self, request: Request, budget: int) -> int:
        """Give a waiting request its cached prefix and first chunk: its new tokens; 0 if the pool
        cannot take it now; _LOOKUP_PENDING or _PARKED (design note 5)."""
        P = self.page_tokens
        reusable = request.num_reusable_pages()
        keys = request.page_keys(reusable)
        hits = self.pool.lookup(keys)
        num_hits = len(hits)

        def blocks_needed(num_remote: int) -> int:
            end = min(request.num_tokens, (num_hits + num_remote) * P + budget)
            return _cdiv(end, P) - num_hits

        available = self.pool.get_num_free_blocks() - self.pool.num_idle(hits)
        if blocks_needed(0) > available:
            return 0
        num_remote = 0
        if self.connector is not None and reusable and id(request) not in self._remote_given_up:
            found = self.connector.get_num_matched_pages(request, keys, hits)
            if found is None:
                return _LOOKUP_PENDING
            num_remote = max(0, found - num_hits)
            while num_remote and blocks_needed(num_remote) > available:
                num_remote -= 1
        self.pool.ref(hits)
        request.block_table = list(hits)
        request.num_cached_pages = num_hits
        request.num_computed_tokens = min(num_hits * P, request.num_tokens - 1)   # design note 5
        if num_remote:
            blocks = self.pool.allocate(num_remote)
            request.block_table += blocks
            self.connector.start_load(request, keys[num_hits:num_hits + num_remote], blocks)
            self.waiting.remove(request)
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.parked.append(request)
            return _PARKED
        if request.cached_tokens_local is None:
            request.cached_tokens_local = request.num_computed_tokens
            request.cached_tokens_remote = 0
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        assert self._can_grow(request, num_new), "admission checked the blocks it needs"
        self._grow(request, num_new)
        return num_new

    def _join_early(self) -> ScheduledBatch | None:
        """A parked request whose layer-wise load is under way, in a step of its own (design note 10)."""
        if self.connector is None:
            return None
        P = self.page_tokens
        for request in self.parked:
            if not self.connector.can_join_early(request):
                continue
            num_hits = request.num_cached_pages
            num_remote = len(request.block_table) - num_hits
            computed = min((num_hits + num_remote) * P, request.num_tokens - 1)   # the last token is computed
            num_new = min(request.num_tokens - computed, self.max_prefill_tokens)
            if _cdiv(computed + num_new, P) - len(request.block_table) > self.pool.get_num_free_blocks():
                continue  # it joins once its load landed, as any parked request
            self.connector.join_early(request)
            set_usage = request.cached_tokens_local is None
            if set_usage:
                request.cached_tokens_local = min(num_hits * P, computed)
                request.cached_tokens_remote = computed - request.cached_tokens_local
            request.num_computed_tokens = computed
            self._early[id(request)] = (num_hits, num_remote, set_usage)
            self.parked.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._grow(request, num_new)
            return ScheduledBatch([request], [num_new], layerwise=True)
        return None

    def _take_finished_loads(self) -> None:
        """Parked requests whose pages landed join the running ones (design note 5)."""
        if self.connector is None:
            return
        finished = self.connector.take_finished_loads()
        for blocks in finished.released:
            self.pool.release(blocks)
        for request in finished.overdue:  # given up: it computes its prompt instead
            log.warning("remote pages for request %s still loading after %.0fs; computing instead",
                        request.request_id, self.connector.timeout_s)
            self.parked.remove(request)
            self.connector.give_up_load(request, request.block_table)
            request.block_table = []
            request.num_cached_pages = 0
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self._remote_given_up.add(id(request))
            self.waiting.appendleft(request)
        for request, filled in finished.landed:
            self._join(request, filled)

    def _join(self, request: Request, filled: int) -> None:
        """Index the pages that landed in a parked request's blocks; it runs from the next step."""
        P = self.page_tokens
        num_hits = request.num_cached_pages
        filled = max(0, min(filled, len(request.block_table) - num_hits))
        keys = request.page_keys(num_hits + filled)
        for page in range(num_hits, num_hits + filled):
            parent = keys[page - 1] if page else None
            request.block_table[page] = self.pool.cache_full_block(request.block_table[page], keys[page], parent)
        request.num_cached_pages = num_hits + filled
        request.num_computed_tokens = min((num_hits + filled) * P, request.num_tokens - 1)   # design note 5
        if request.cached_tokens_local is None:
            request.cached_tokens_local = min(num_hits * P, request.num_computed_tokens)
            request.cached_tokens_remote = request.num_computed_tokens - request.cached_tokens_local
        self.parked.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
