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
2. Pages read in place (connector design note 8): a load that ends with its pages pinned in a
   same-host node's pool joins like any, its pages counted as computed, but they are not in its
   blocks yet: its first step reads them where they lie (`forward_table` points its table
   there), and the next `schedule` copies them into its blocks, indexes them and lets the node
   have them back (`_land_in_place`), so the copy follows the first token instead of preceding
   it, and the pins last one step. A request that lost its blocks meanwhile (finished after one
   token, preempted, aborted: `_drop_in_place`) gives the pages back uncopied: its blocks never
   held them and were never indexed. The pages' checksums are checked beside that first forward
   (worker/pages_in_place.py note 2): after it, `settle_in_place` waits for the check, and a
   request whose pages failed it loses the step's work (no token), gives its blocks and the pages
   back and waits to compute its prompt without them, as after a layer-wise load that failed
   (the pages before the altered one copied in and cached first, so it reuses those); a request
   not in that step has its pages checked before they are copied.
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
        """Index the pages that landed in a parked request's blocks (or, read in place, note 2, once
        its first step read them); it runs from the next step."""
        P = self.page_tokens
        num_hits = request.num_cached_pages
        if isinstance(filled, int):
            filled = max(0, min(filled, len(request.block_table) - num_hits))
            self._index_pages(request, num_hits, num_hits + filled)
        elif request.block_table[num_hits : num_hits + len(filled)] == filled.blocks:
            self._in_place[id(request)] = (request, filled, num_hits)
            filled = len(filled)
        else:  # not the blocks it was fetched for: nothing read in place
            filled.release()
            filled = 0
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
        for page in range(start, end):
            parent = keys[page - 1] if page else None
            request.block_table[page] = self.pool.cache_full_block(request.block_table[page], keys[page], parent)

    def _land_in_place(self) -> None:
        """Copy the pages the last step read in place into their blocks, index them, give them back (note 2)."""
        for request, pages, num_hits in list(self._in_place.values()):
            if request.status is not RequestStatus.RUNNING or \
                    request.block_table[num_hits : num_hits + len(pages)] != pages.blocks:
                self._drop_in_place(request)  # its blocks went back meanwhile: they never held them
            elif not pages.intact():  # not in the last step, or it would have been settled
                self._discard_in_place(request)
            else:
                try:
                    pages.land(self.pool.arena.all_blocks)
                    self._index_pages(request, num_hits, num_hits + len(pages))
                finally:
                    self._drop_in_place(request)

    def settle_in_place(self, requests) -> set[int]:
        """After a forward: the ids of those of `requests` whose pages read in place turned out
        altered, their step's work to be thrown away (note 2); the others' were intact."""
        failed = set()
        for request in requests:
            entry = self._in_place.get(id(request))
            if entry is not None and not entry[1].intact():
                self._discard_in_place(request)
                failed.add(id(request))
        return failed

    def _discard_in_place(self, request: Request) -> None:
        """A request whose pages read in place are altered computes its prompt without them,
        reusing those before the altered one (note 2)."""
        _, pages, num_hits = self._in_place[id(request)]
        intact = pages.num_intact()
        log.warning("page %d of the %d of request %s read in place did not match its checksum; computing its "
                    "prompt without it and those after it", intact, len(pages), request.request_id)
        if intact:  # cached, so the recompute reuses them
            pages.land(self.pool.arena.all_blocks, intact)
            self._index_pages(request, num_hits, num_hits + intact)
        self.running.remove(request)
        self._release(request)  # and the pages (_drop_in_place)
        request.status = RequestStatus.WAITING
        self._remote_given_up.add(id(request))
        if request.cached_tokens_remote:  # set by the join: what it will reuse, as a layer-wise discard says
            request.cached_tokens_local, request.cached_tokens_remote = (
                (num_hits * self.page_tokens, intact * self.page_tokens) if intact else (None, None))
        self.num_in_place_discarded += 1
        self.waiting.appendleft(request)

    def _drop_in_place(self, request: Request) -> None:
        """A request giving up its blocks gives its pages read in place back uncopied (note 2)."""
        entry = self._in_place.pop(id(request), None)
        if entry is not None:
            entry[1].release()

    def forward_table(self, request: Request) -> tuple[list[int], bool]:
        """The block table a forward reads for `request`: its own, with pages read in place pointing
        where they lie (note 2); and whether any do (the forward then reads the arena's blocks)."""
        entry = self._in_place.get(id(request))
        if entry is None:
            return request.block_table, False
        _, pages, num_hits = entry
        table = list(request.block_table)
        table[num_hits : num_hits + len(pages)] = pages.arena_blocks
        return table, True

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
