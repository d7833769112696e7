"""Parked requests joining the batch: a request whose remote pages are on their way is parked
(scheduler design note 5); it joins the running ones in the first step after its load ended, or,
under a layer-wise load, early, in a step of its own before every layer landed.

`RemoteJoins` is a part of the Scheduler (worker/scheduler.py), kept apart so that the scheduler
reads as its step rules. It works on the scheduler's state: `parked`, `running`, `waiting`, the
pool, the connector, `_early` (id -> local hits, remote pages, usage set here) and
`_remote_given_up`, and its `_grow` and `_release`.

Design notes
1. Layer-wise overlap (issue 19, connector design note 7): a parked request whose layer-wise
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
2. Pages read in place (connector design note 8) join through `_join` too: worker/in_place_joins.py.
"""

from __future__ import annotations

import logging

from worker.request import Request, RequestStatus
from worker.scheduled_batch import ScheduledBatch

log = logging.getLogger("worker.scheduler")  # its messages are the scheduler's


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RemoteJoins:
    """The Scheduler's handling of parked requests once their remote pages land (a mixin)."""

    def _take_finished_loads(self) -> None:
        """Parked requests whose pages landed join the running ones (scheduler design note 5)."""
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

    def _join(self, request: Request, filled) -> None:
        """Index the pages that landed in a parked request's blocks (or, read in place, once its first
        step read them: note 2); it runs from the next step."""
        P = self.page_tokens
        num_hits = request.num_cached_pages
        if not isinstance(filled, int):  # pages read in place (worker/in_place_joins.py)
            filled = self._join_in_place(request, filled)
        else:
            filled = max(0, min(filled, len(request.block_table) - num_hits))
            self._index_pages(request, num_hits, num_hits + filled)
        request.num_cached_pages = num_hits + filled
        request.num_computed_tokens = min((num_hits + filled) * P, request.num_tokens - 1)   # scheduler design note 5
        if request.cached_tokens_local is None:
            request.cached_tokens_local = min(num_hits * P, request.num_computed_tokens)
            request.cached_tokens_remote = request.num_computed_tokens - request.cached_tokens_local
        self.parked.remove(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _index_pages(self, request: Request, start: int, end: int) -> None:
        """Index pages start..end of a request's blocks in the local prefix cache."""
        keys = request.page_keys(end)
        request.block_table[start:end] = self._index_blocks(request.block_table[start:end], keys[start:],
                                                            keys[start - 1] if start else None)

    def _index_blocks(self, blocks: list[int], keys: list[bytes], parent: bytes | None) -> list[int]:
        """Index full blocks under their keys, in order, those not indexed yet (pages a step filled
        after pages read in place are: worker/in_place_joins.py note 1); the blocks that hold the keys."""
        held = []
        for block, key in zip(blocks, keys):
            if self.pool.block_keys[block] is None:
                block = self.pool.cache_full_block(block, key, parent)
            held.append(block)
            parent = key
        return held

    def _join_early(self) -> ScheduledBatch | None:
        """A parked request whose layer-wise load is under way, in a step of its own (design note 1)."""
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

    def settle_layerwise(self, request: Request) -> bool:
        """After an early-joined request's step (design note 1): True, its remote pages indexed,
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
        pages', and while it runs early (design note 1) those of its remote pages still landing."""
        early = self._early.get(id(request))
        pages = early[0] + early[1] if early is not None else request.num_cached_pages
        return pages * self.page_tokens

    def repark(self, request: Request) -> None:
        """An early-joined request whose step was cut short by a late layer waits for its load again
        (design note 1): the blocks of its suffix go back, its remote ones stay the loader's."""
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

    def _end_early_join(self, request: Request) -> None:
        """A request that ends (done or aborted) in its early-joined step (design note 1): the loader
        may still write its remote blocks, so those are released only once it let go of them."""
        early = self._early.pop(id(request), None)
        if early is not None:
            num_hits, num_remote, _ = early
            if self.connector.settle_layerwise(request, request.block_table[num_hits : num_hits + num_remote],
                                               wait_s=0.0) is None:
                del request.block_table[num_hits : num_hits + num_remote]
