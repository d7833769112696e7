"""Continuous batching over the block pool: which requests run in the next step, and with how
many new tokens each. Requests join and leave between steps.

One rule serves prefill and decode (vLLM v1's): a request has `num_tokens` and
`num_computed_tokens` (tokens whose K/V are in its blocks), and each step gives it
`min(num_tokens - num_computed_tokens, budget)` new tokens; a step that reaches `num_tokens`
yields logits for the next token, a shorter one is a prefill chunk. `schedule` takes the decodes,
then one prompt; `_admit` gives a waiting request its cached pages, local and remote. Who goes
first and who gives way is worker/engine/priority.py's; requests whose remote pages arrive join
through worker/engine/remote_joins.py and worker/engine/in_place_joins.py.
"""

from __future__ import annotations

from collections import deque

from worker.kv.block_pool import BlockPool
from worker.engine.block_tables import BlockTables, release_passed_blocks
from worker.connector.connector import Connector
from worker.engine.in_place_joins import InPlaceJoins
from worker.engine.priority import PriorityPolicy
from worker.engine.remote_joins import RemoteJoins
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduled_batch import ScheduledBatch


def _tokens_left(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


PREFILL_TOKENS_PER_STEP = 128  # prompt tokens in a step with decodes at most: bounds their wait, and a new prompt's
ALONE_PREFILL_TOKENS = 512     # in a step without: no running request waits, and larger weight products run faster
AGING_STEPS = 64                # steps waited after which a request goes before every younger one
JOIN_TOKENS = 16                # tokens other prompts may add to a step's prefill if they finish in it

_LOOKUP_PENDING = -1  # _admit: the connector's lookup has not answered yet
_PARKED = -2          # _admit: blocks given, remote pages on their way (the request is parked)


class Scheduler:
    def __init__(self, pool: BlockPool, page_tokens: int, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 1024, connector: Connector | None = None,
                 max_prefill_tokens: int = PREFILL_TOKENS_PER_STEP, alone_prefill_tokens: int = ALONE_PREFILL_TOKENS,
                 aging_steps: int = AGING_STEPS, join_tokens: int = JOIN_TOKENS, release_window: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
                             f"max_num_seqs ({max_num_seqs}), so every running request can decode each step")
        if max_prefill_tokens < 1 or alone_prefill_tokens < 1 or aging_steps < 0 or join_tokens < 0:
            raise ValueError(f"max_prefill_tokens and alone_prefill_tokens must be at least 1, aging_steps and "
                             f"join_tokens at least 0, got {max_prefill_tokens}, {alone_prefill_tokens}, "
                             f"{aging_steps} and {join_tokens}")
        self.pool = pool
        self.page_tokens = page_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.alone_prefill_tokens = max(alone_prefill_tokens, max_prefill_tokens)  # never a smaller chunk alone
        self.join_tokens = join_tokens
        self.release_window = release_window  # a sliding window (on_computed); None keeps every page to the end
        self.tables = BlockTables(pool, page_tokens)
        self.priority = PriorityPolicy(aging_steps)  # priorities and aging order the prefill and preemption
        self.in_place = InPlaceJoins(self.tables)  # pages read in place (worker/engine/in_place_joins.py)
        self.remote = RemoteJoins(self.tables, self.in_place, max_prefill_tokens, connector)  # parked ones joining
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order, oldest first
        self.parked: list[Request] = []  # waiting for remote KV (_admit): blocks held, not scheduled
        self.num_preemptions = 0
        self.num_steps = 0

    @property
    def connector(self) -> Connector | None:
        return self.remote.connector

    def set_connector(self, connector: Connector | None) -> None:
        """Plug in (or remove) the remote tier's connector, while no request waits for the old one."""
        assert not self.parked, "requests wait for the connector being replaced"
        self.remote.connector = connector

    def add(self, request: Request) -> None:
        max_blocks = self.pool.num_blocks
        if self.tables.num_pages(request.num_tokens) > max_blocks:
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
        for request in self.in_place.land():  # before anything may take blocks (InPlaceJoins.land)
            self._wait_again(request)
        self._take_finished_loads()
        # An early join's step is its own: the chunk of a step without decodes when none is decoding.
        decoding = any(_tokens_left(r) == 1 for r in self.running)
        early = self.remote.join_early(self.parked, self.max_prefill_tokens if decoding else self.alone_prefill_tokens)
        if early is not None:
            request, num_new = early
            self._move(request, self.parked, RequestStatus.RUNNING)
            return ScheduledBatch([request], [num_new], layerwise=True)
        self._preempt_for_priority()
        batch = ScheduledBatch([], [])
        preempted = False
        # Decodes first, oldest first: every running request with one token left gets it each step,
        # so decoding is never starved (the token budget holds one token per seat).
        for request in [r for r in self.running if _tokens_left(r) == 1]:
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted to make room for an older one
            preempted |= self._make_room(request, 1, batch)
            if request.status is RequestStatus.RUNNING:
                self._add_to_batch(batch, request, 1)
        # Then one prompt, the one with the fewest tokens left (_prefill_order), max_prefill_tokens of
        # it beside decodes, alone_prefill_tokens in a step without (nobody waits on it; larger chunks
        # run faster); others join only if they finish within join_tokens more. One, because on a CPU
        # a second prompt's chunk would delay the first one's first token by its whole cost.
        chunk = self.max_prefill_tokens if batch.requests else self.alone_prefill_tokens
        budget = min(self.max_num_batched_tokens - sum(batch.num_new_tokens), chunk)
        pool_short = False
        joining = None  # once the step has its prefill: tokens that prompts finishing with it may add
        for request, left in self._prefill_order(batch) if budget > 0 else []:
            if joining is not None and left > joining:
                continue
            limit = budget if joining is None else joining
            # Where the pool lacks room for a chunk larger than max_prefill_tokens, the prompt takes
            # max_prefill_tokens: a faster chunk is not worth a preemption or a held admission.
            fallback = self.max_prefill_tokens if joining is None else None
            if request.status is RequestStatus.RUNNING:
                num_new = min(_tokens_left(request), limit)
                if fallback is not None and not self.tables.can_grow(request, num_new):
                    num_new = min(num_new, fallback)
                preempted |= self._make_room(request, num_new, batch)
                if request.status is not RequestStatus.RUNNING:
                    continue
                self._add_to_batch(batch, request, num_new)
            else:
                if preempted or pool_short or self.num_seats_taken() >= self.max_num_seqs:
                    continue  # no admission now; running requests later in the order may still compute
                num_new = self._admit(request, limit, fallback)
                if num_new == 0:
                    pool_short = True  # no request later in the order is admitted before this one
                    continue
                if num_new < 0:
                    continue  # its lookup is in flight, or it is parked while its pages arrive
                self._move(request, self.waiting, RequestStatus.RUNNING)
                batch.requests.append(request)
                batch.num_new_tokens.append(num_new)
            if joining is None:  # others join only a prompt that finishes here, not one the pool cut short
                finishes = request.num_computed_tokens + num_new == request.num_tokens
                joining = min(self.join_tokens, budget - num_new) if finishes else 0
            else:
                joining -= num_new
            if joining <= 0:
                break
        assert batch.requests or not self.running, "requests are running but none could be scheduled"
        batch.admission_held = preempted or pool_short
        return batch

    def schedule_newcomer(self, step: ScheduledBatch) -> ScheduledBatch | None:
        """Between two layers of `step`'s forward: a waiting request to compute whole before the
        step goes on, or None.

        A request that arrives while a step computes a prompt's chunk, with less left to compute
        than that chunk, would have been the step's prompt had it come a moment earlier, and
        waiting for the rest of the chunk would be most of its time to first token: it is admitted
        alone and computed whole. Nothing is preempted for it, nor is it admitted after a step
        that preempted or found the pool short (`admission_held`), and a step whose prompt was
        chosen by aging is never paused, so aging still bounds a long prompt's wait in steps (a
        step lasts longer by the newcomers it carries, at most one per layer)."""
        chunk = max(step.num_new_tokens)
        if (chunk <= self.join_tokens or not self.waiting or self.num_seats_taken() >= self.max_num_seqs
                or step.admission_held
                or self.priority.aged(step.requests[step.num_new_tokens.index(chunk)], self.num_steps)):
            return None
        left, request = min(((self._tokens_to_compute(r), r) for r in self.waiting), key=lambda entry: entry[0])
        if left >= chunk:
            return None
        num_new = self._admit(request, left)
        if num_new <= 0:
            return None  # the pool cannot take it without preempting, or it waits for its remote pages
        self._move(request, self.waiting, RequestStatus.RUNNING)
        return ScheduledBatch([request], [num_new])

    def on_computed(self, request: Request, num_new_tokens: int) -> None:
        """After the forward pass: the tokens are computed; index and announce pages that became
        full, then release those a sliding window left behind."""
        request.num_computed_tokens += num_new_tokens
        if not request.bypass_cache:
            self._cache_full_pages(request)
        # A sliding window (worker/kv/window.py): release the blocks no later query reads, once the
        # full pages are cached and copied for the tier (just above), so a request holds about
        # W / page_tokens + 1 blocks however long it grows.
        if self.release_window is not None:
            release_passed_blocks(request, self.pool, self.release_window, self.page_tokens)

    def finish(self, request: Request) -> None:
        """Remove a request (done or aborted) wherever it is and release its blocks at once."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.parked.remove(request)
        self.remote.finish(request)
        self._release(request)
        request.status = RequestStatus.FINISHED

    # ---- the engine's step: remote pages (worker/engine/remote_joins.py, worker/engine/in_place_joins.py) ----

    def settle_layerwise(self, request: Request) -> bool:
        """After an early-joined request's step: True when its remote pages all arrived intact; else
        False, the step's work thrown away and the request waiting to compute its prompt
        (RemoteJoins.join_early)."""
        if self.remote.settle_layerwise(request):
            return True
        self._wait_again(request)
        return False

    def repark(self, request: Request) -> None:
        """An early-joined request whose step was cut short by a late layer waits for its load again."""
        self.remote.repark(request)
        self._move(request, self.running, RequestStatus.WAITING_FOR_REMOTE_KVS)

    def settle_in_place(self, requests) -> set[int]:
        """After a forward: the ids of those of `requests` whose pages read in place turned out
        altered, their step's work thrown away, they waiting to compute their prompt again."""
        altered = self.in_place.settle(requests)
        for request in altered:
            self._wait_again(request)
        return {id(request) for request in altered}

    # ---- internals -----------------------------------------------------------

    def _move(self, request: Request, queue, status: RequestStatus) -> None:
        """From `queue` to the end of the running or parked ones."""
        queue.remove(request)
        request.status = status
        (self.running if status is RequestStatus.RUNNING else self.parked).append(request)

    def _wait_again(self, request: Request) -> None:
        """A running request gives its blocks up and waits, first in line, to compute again."""
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _take_finished_loads(self) -> None:
        """Parked requests whose pages landed join the running ones, what landed counted as computed
        and the rest to compute. A load the connector reports overdue is given up (its blocks
        released once the loader lets go of them): its request computes its prompt, first in line."""
        landed, overdue = self.remote.take_finished_loads(copy_in_place=self.release_window is not None)
        for request in overdue:  # given up: it computes its prompt instead
            self.parked.remove(request)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        for request in landed:
            self._move(request, self.parked, RequestStatus.RUNNING)

    def _cache_full_pages(self, request: Request) -> None:
        """Index the pages that became full in the prefix cache and announce each to the tier (its
        write-back), so later prompts, here and on other workers, reuse them."""
        for key, parent, block_id in self.tables.cache_full_pages(request):
            if self.connector is not None:
                self.connector.on_page_full(key, parent or b"", block_id, request.tier_context)

    def _release(self, request: Request) -> None:
        self.in_place.stash(request)  # its pages read in place, cached by the next step (InPlaceJoins.stash)
        self.tables.release(request)

    def _add_to_batch(self, batch: ScheduledBatch, request: Request, num_new: int) -> None:
        self.tables.grow(request, num_new)
        batch.requests.append(request)
        batch.num_new_tokens.append(num_new)

    # ---- who goes first, who gives way (worker/engine/priority.py) ----

    def _prefill_order(self, batch: ScheduledBatch) -> list[tuple[Request, int]]:
        """Running requests mid-prompt and waiting ones, with the tokens each still has to compute,
        in prefill order (PriorityPolicy.prefill_order); ties keep running before waiting, queue order."""
        candidates = [r for r in self.running if r not in batch.requests] + list(self.waiting)
        return self.priority.prefill_order([(r, self._tokens_to_compute(r)) for r in candidates], self.num_steps)

    def _preempt(self, request: Request) -> None:
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._wait_again(request)

    def _make_room(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Preempt running requests outside the batch until `request` can grow (whom:
        PriorityPolicy.victim); it may be preempted itself. True if anything was preempted."""
        preempted = False
        while not self.tables.can_grow(request, num_new):
            victim = self.priority.victim(self.running, batch.requests, self.num_steps)
            self._preempt(victim)
            preempted = True
            if victim is request:
                break
        return preempted

    def _preempt_for_priority(self) -> None:
        """Before the step takes its decodes: if the first waiting request in the prefill order lacks
        a seat or blocks, preempt running requests of a higher priority value for it
        (PriorityPolicy.lower_victim)."""
        if not self.waiting:
            return
        no_batch = ScheduledBatch([], [])
        request = next((r for r, _ in self._prefill_order(no_batch) if r.status is RequestStatus.WAITING), None)
        if request is None or (self.connector is not None and self.connector.lookups.in_flight(request)):
            return  # it could not be admitted now anyway
        hits = self.pool.lookup(request.page_keys(request.num_reusable_pages()))
        # The chunk of a step with decodes: a larger one is taken only where the pool has room (schedule).
        first_chunk_end = min(request.num_tokens, self._num_cached(request) + self.max_prefill_tokens)
        needed = self.tables.num_pages(first_chunk_end) - len(hits)
        # Its own idle cached prefix counts among the free blocks, but admission takes a reference
        # on it (_admit): those blocks are not there for its chunk.
        while (self.num_seats_taken() >= self.max_num_seqs
               or needed > self.pool.get_num_free_blocks() - self.pool.num_idle(hits)):
            victim = self.priority.lower_victim(request, self.running, no_batch.requests, self.num_steps)
            if victim is None:
                return
            self._preempt(victim)

    # ---- admission ----

    def _tokens_to_compute(self, request: Request) -> int:
        """Prompt tokens a request still has to compute (a waiting one: after its cached prefix)."""
        if request.status is RequestStatus.RUNNING:
            return _tokens_left(request)
        return request.num_tokens - self._num_cached(request)

    def _num_cached(self, request: Request) -> int:
        """Prompt tokens a waiting request would reuse from the local prefix cache now, or from
        the remote tier if its lookup (started when it arrived) answered with more: a prompt
        mostly cached on the kvnodes goes first as one cached here does."""
        if request.bypass_cache:
            return 0
        pages = len(self.pool.lookup(request.page_keys(request.num_reusable_pages())))
        if self.connector is not None and not request.remote_given_up:
            pages = max(pages, self.connector.lookups.peek(request) or 0)
        return min(pages * self.page_tokens, request.num_tokens - 1)   # the last token is computed

    def _admit(self, request: Request, budget: int, fallback: int | None = None) -> int:
        """Give a waiting request its cached prefix and first chunk (`budget` tokens, `fallback` where
        the pool lacks room): its new tokens; 0 if the pool cannot take it now; _LOOKUP_PENDING while
        the tier's lookup is in flight; _PARKED when remote pages past its local hits are on their way.
        The tier hears of the whole chain, local hits included, so it learns what it lacks (write_back)."""
        P = self.page_tokens
        reusable = request.num_reusable_pages()
        keys = request.page_keys(reusable)
        hits = self.pool.lookup(keys)
        num_hits = len(hits)

        def blocks_needed(num_remote: int) -> int:
            end = min(request.num_tokens, (num_hits + num_remote) * P + budget)
            return self.tables.num_pages(end) - num_hits

        available = self.pool.get_num_free_blocks() - self.pool.num_idle(hits)
        if fallback is not None and fallback < budget and blocks_needed(0) > available:
            budget = fallback
        if blocks_needed(0) > available:
            return 0
        num_remote = 0
        if self.connector is not None and reusable and not request.remote_given_up:
            self.connector.lookups.start(request, keys)  # unless its answer for these keys stands
            found = self.connector.lookups.take(request)
            if found is None:
                return _LOOKUP_PENDING
            if found < num_hits:
                self.connector.write_back(request, keys, hits, found)
            num_remote = max(0, found - num_hits)
            if fallback is not None and fallback < budget and blocks_needed(num_remote) > available:
                budget = fallback  # remote pages save more than a larger chunk
            while num_remote and blocks_needed(num_remote) > available:
                num_remote -= 1
        self.pool.ref(hits)
        request.block_table = list(hits)
        request.num_cached_pages = num_hits
        # Every full page may be reused, but the last prompt token is always computed (its logits give
        # the next token), reading its K/V from the cached page and writing nothing there (cached_lens).
        request.num_computed_tokens = min(num_hits * P, request.num_tokens - 1)
        if num_remote:
            # Parked while the connector fetches its pages: holding a seat, not scheduled nor preempted.
            blocks = self.pool.allocate(num_remote)
            request.block_table += blocks
            self.connector.start_load(request, keys[num_hits:num_hits + num_remote], blocks)
            self._move(request, self.waiting, RequestStatus.WAITING_FOR_REMOTE_KVS)
            return _PARKED
        if request.cached_tokens_local is None:
            request.cached_tokens_local = request.num_computed_tokens
            request.cached_tokens_remote = 0
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        assert self.tables.can_grow(request, num_new), "admission checked the blocks it needs"
        self.tables.grow(request, num_new)
        return num_new
