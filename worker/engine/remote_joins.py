"""Parked requests joining the batch: a request whose remote pages are on their way is parked
(Scheduler._admit); it joins the running ones in the first step after its load ended, or, under
a layer-wise load, early, in a step of its own before every layer landed (join_early).

`RemoteJoins` holds the connector and what the scheduler (worker/engine/scheduler.py) needs to know of
the loads under way; the scheduler moves requests between its queues. Pages read in place join
through `_join` too, then worker/engine/in_place_joins.py takes them over.
"""

from __future__ import annotations

import logging
from typing import Sequence

from worker.engine.block_tables import BlockTables
from worker.connector.connector import Connector, Landed
from worker.engine.in_place_joins import InPlaceJoins
from worker.engine.request import Request, RequestStatus

log = logging.getLogger("worker.scheduler")  # its messages are the scheduler's


class RemoteJoins:
    """Parked requests whose remote pages landed, or are landing layer by layer (join_early)."""

    def __init__(self, tables: BlockTables, in_place: InPlaceJoins, max_prefill_tokens: int,
                 connector: Connector | None):
        self.tables = tables
        self.in_place = in_place
        self.max_prefill_tokens = max_prefill_tokens
        self.connector = connector  # None: no remote tier
        self.num_layerwise_discarded = 0  # early-joined steps thrown away (settle_layerwise)
        self._early: dict[int, tuple[int, int, bool]] = {}  # id -> (local hits, remote pages, usage set here)

    def take_finished_loads(self, copy_in_place: bool) -> tuple[list[Request], list[Request]]:
        """Parked requests whose pages landed, their pages indexed (or read in place from their next
        step: InPlaceJoins.join), to run; and those whose load is overdue, given up, to compute their
        prompt. `copy_in_place`: pages read in place are copied in at the join."""
        if self.connector is None:
            return [], []
        finished = self.connector.take_finished_loads()
        for blocks in finished.released:
            self.tables.pool.release(blocks)
        for request in finished.overdue:
            log.warning("remote pages for request %s still loading after %.0fs; computing instead",
                        request.request_id, self.connector.timeout_s)
            self.connector.drop(request, request.block_table)
            request.block_table = []
            request.num_cached_pages = 0
            request.num_computed_tokens = 0
            request.remote_given_up = True
        for request, landed in finished.landed:
            self._join(request, landed, copy_in_place)
        return [request for request, _ in finished.landed], finished.overdue

    def _join(self, request: Request, landed: Landed, copy_in_place: bool) -> None:
        """Index the pages that landed in a parked request's blocks (or, read in place, once its first
        step read them: InPlaceJoins.join), counted as computed."""
        P = self.tables.page_tokens
        num_hits = request.num_cached_pages
        if landed.pages_in_place is not None:  # worker/engine/in_place_joins.py
            filled = self.in_place.join(request, landed.pages_in_place, copy_in_place)
        else:
            filled = max(0, min(landed.num_pages, len(request.block_table) - num_hits))
            self.tables.index_pages(request, num_hits, num_hits + filled)
        request.num_cached_pages = num_hits + filled
        request.num_computed_tokens = min((num_hits + filled) * P, request.num_tokens - 1)   # as Scheduler._admit
        if request.cached_tokens_local is None:
            request.cached_tokens_local = min(num_hits * P, request.num_computed_tokens)
            request.cached_tokens_remote = request.num_computed_tokens - request.cached_tokens_local

    def join_early(self, parked: Sequence[Request], chunk: int) -> tuple[Request, int] | None:
        """A parked request whose layer-wise load is under way, and its new tokens, to run in a step of
        its own: its remote pages counted as computed and its blocks grown. It computes `chunk` tokens
        at most (the scheduler's for the step), max_prefill_tokens where the pool lacks room for more.

        The step is its own so that no other request shares its waits on the network: the forward
        waits, briefly, for each layer of its pages (StepRunner._step_layerwise), and a layer that
        is late sends it back to the parked ones (repark). Its remote pages are indexed only once
        every one arrived intact (settle_layerwise). A step with no blocks for its first chunk
        leaves it parked."""
        if self.connector is None:
            return None
        P = self.tables.page_tokens
        for request in parked:
            if not self.connector.layerwise_loads.can_join_early(request):
                continue
            num_hits = request.num_cached_pages
            num_remote = len(request.block_table) - num_hits
            computed = min((num_hits + num_remote) * P, request.num_tokens - 1)   # the last token is computed
            num_new = min(request.num_tokens - computed, chunk)
            free = self.tables.pool.get_num_free_blocks()
            if self.tables.num_pages(computed + num_new) - len(request.block_table) > free:
                num_new = min(num_new, self.max_prefill_tokens)  # as Scheduler.schedule where the pool is short
            if self.tables.num_pages(computed + num_new) - len(request.block_table) > free:
                continue  # it joins once its load landed, as any parked request
            self.connector.layerwise_loads.join_early(request)
            set_usage = request.cached_tokens_local is None
            if set_usage:
                request.cached_tokens_local = min(num_hits * P, computed)
                request.cached_tokens_remote = computed - request.cached_tokens_local
            request.num_computed_tokens = computed
            self._early[id(request)] = (num_hits, num_remote, set_usage)
            self.tables.grow(request, num_new)
            return request, num_new
        return None

    def settle_layerwise(self, request: Request) -> bool:
        """After an early-joined request's step: True, its remote pages indexed, when every one
        arrived intact; else False, the step's work to be thrown away and the request to compute
        its prompt without them (the scheduler sends it back to wait), reusing only the leading
        pages that arrived whole and intact, its usage then saying so."""
        num_hits, num_remote, set_usage = self._early.pop(id(request))
        remote = request.block_table[num_hits : num_hits + num_remote]
        filled = self.connector.layerwise_loads.settle(request, remote)
        if filled == num_remote:
            self._cache_pages(request, num_hits, num_hits + num_remote)
            request.num_cached_pages = num_hits + num_remote
            return True
        self.num_layerwise_discarded += 1
        log.info("remote pages of request %s did not all arrive intact (%s of %d); computing its prompt without "
                 "the others", request.request_id, "a load given up" if filled is None else filled, num_remote)
        if filled is None:  # the loader may still write them: released once it is done
            del request.block_table[num_hits : num_hits + num_remote]
        elif filled:  # whole and intact: cached, so the recompute reuses them
            self._cache_pages(request, num_hits, num_hits + filled)
        request.remote_given_up = True
        if set_usage:  # what it will reuse: the local hits and the remote pages that were intact
            P = self.tables.page_tokens
            request.cached_tokens_local, request.cached_tokens_remote = (
                (num_hits * P, filled * P) if filled else (None, None))
        return False

    def _cache_pages(self, request: Request, start: int, end: int) -> None:
        """Index the freshly landed pages start..end of an early-joined request."""
        keys = request.page_keys(end)
        for page in range(start, end):
            parent = keys[page - 1] if page else None
            request.block_table[page] = self.tables.pool.cache_full_block(request.block_table[page], keys[page], parent)

    def num_reused_tokens(self, request: Request) -> int:
        """Tokens whose K/V came from a cache into its blocks, never to be written again: its cached
        pages', and while it runs early (join_early) those of its remote pages still landing."""
        early = self._early.get(id(request))
        pages = early[0] + early[1] if early is not None else request.num_cached_pages
        return pages * self.tables.page_tokens

    def repark(self, request: Request) -> None:
        """An early-joined request whose step was cut short by a late layer waits for its load again,
        to join when it ended as any parked request: the blocks of its suffix go back, its remote
        ones stay the loader's."""
        num_hits, num_remote, set_usage = self._early.pop(id(request))
        self.tables.pool.release(request.block_table[num_hits + num_remote :])
        del request.block_table[num_hits + num_remote :]
        request.num_computed_tokens = min(num_hits * self.tables.page_tokens, request.num_tokens - 1)
        if set_usage:
            request.cached_tokens_local = request.cached_tokens_remote = None
        self.connector.layerwise_loads.unjoin(request)

    def finish(self, request: Request) -> None:
        """A request ends (done or aborted): its lookup is dropped, and a load it waits for, or ran
        early with (join_early), given up; the loader may still write those blocks, so they are
        released only once it let go of them."""
        if self.connector is None:
            return
        early = self._early.pop(id(request), None)
        if early is not None:
            num_hits, num_remote, _ = early
            if self.connector.layerwise_loads.settle(request, request.block_table[num_hits : num_hits + num_remote],
                                                     wait_s=0.0) is None:
                del request.block_table[num_hits : num_hits + num_remote]
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.connector.drop(request, request.block_table)  # released when the loader is done
            request.block_table = []
        else:
            self.connector.drop(request)
