"""Requests whose fetched pages are read in place (worker/kv/pages_in_place.py): how they join, what
their first forward reads, and how the pages end up in their blocks.

A load that ends with its pages pinned in a same-host node's pool (RemoteTier.fill_in_place) joins
like any, its pages counted as computed, but they are not in its blocks yet: its first step reads
them where they lie (`forward_table`), and the next `schedule` copies them in and gives them back
(`land`), so the copy follows the first token instead of preceding it and the pins last one step.

`InPlaceJoins` holds those requests and their pages from the join to the landing; the scheduler
(worker/engine/scheduler.py) moves requests between its queues, this tells it which to send back.
"""

from __future__ import annotations

import logging

from worker.engine.block_tables import BlockTables
from worker.kv.pages_in_place import LAND_WITHIN_S, PagesInPlace
from worker.engine.request import Request

log = logging.getLogger("worker.scheduler")  # its messages are the scheduler's


class InPlaceJoins:
    """Requests reading pages in place, and pages left to land by requests gone (land, stash)."""

    def __init__(self, tables: BlockTables):
        self.tables = tables
        self.num_discarded = 0  # steps thrown away: pages read in place were altered (settle)
        self._reading: dict[int, tuple[Request, PagesInPlace, int]] = {}  # id -> (request, its pages, local hits)
        self._landing: list[tuple] = []  # (pages, blocks, keys, key before) of requests gone (stash)

    def join(self, request: Request, pages: PagesInPlace, copy_now: bool) -> int:
        """How many of a joining request's pages count as computed: all, read in place from its next
        step; or, when `copy_now` or for pins too old (LAND_WITHIN_S), those copied in now, checked.
        `copy_now` is for a model with a sliding window: its steps release the blocks behind the
        window, those of pages read in place among them, so its pages are copied in at the join."""
        num_hits = request.num_cached_pages
        if pages.released or request.block_table[num_hits : num_hits + len(pages)] != pages.blocks:
            pages.release()  # given up meanwhile (the connector closed), or not its blocks: computed
            return 0
        if not copy_now and pages.fresh():
            self._reading[id(request)] = (request, pages, num_hits)
            return len(pages)
        try:
            intact = pages.num_intact() if pages.fresh() else 0
            if intact:
                pages.land(self.tables.pool.arena.all_blocks, intact)
                self.tables.index_pages(request, num_hits, num_hits + intact)
            return intact
        finally:
            pages.release()

    def num_reading(self) -> int:
        """Requests whose next step reads pages in place."""
        return len(self._reading)

    def forward_table(self, request: Request) -> tuple[list[int], bool]:
        """The block table a forward reads for `request`: its own, with pages read in place pointing
        where they lie; and whether any do (the forward then reads the arena's blocks)."""
        entry = self._reading.get(id(request))
        if entry is None:
            return request.block_table, False
        _, pages, num_hits = entry
        table = list(request.block_table)
        table[num_hits : num_hits + len(pages)] = pages.arena_blocks
        return table, True

    def settle(self, requests) -> list[Request]:
        """After a forward: those of `requests` whose pages read in place turned out altered, their
        step's work to be thrown away and they to wait again; the others' were intact.

        The pages' checksums are checked beside the forward; this waits for the check. A request
        whose pages failed it gets no token from the step, keeps the pages before the altered one
        (copied in and cached: _discard) and computes the rest, as after a failed layer-wise load.
        A request not in that step has its pages checked before they are copied (land)."""
        altered = []
        for request in requests:
            entry = self._reading.get(id(request))
            if entry is not None and not entry[1].intact():
                self._discard(request)
                altered.append(request)
        return altered

    def has_landings(self) -> bool:
        """Pages read in place still to copy in and give back: the next step does it (the engine
        steps once more while any are pending)."""
        return bool(self._landing or self._reading)

    def land(self) -> list[Request]:
        """Copy the pages the last step read in place into their blocks, index them (and the pages
        that step filled after them, which could not be indexed before their parent), give them
        back to the node; the requests whose pages could not be, to wait again."""
        pool = self.tables.pool
        landing, self._landing = self._landing, []
        for pages, blocks, keys, parent in landing:  # of requests that gave their blocks up (stash)
            try:
                copied = pages.fresh() and pages.intact()
                if copied:
                    pages.land(pool.arena.all_blocks)
                held = self.tables.index_blocks(blocks if copied else blocks[len(pages):],
                                                keys if copied else keys[len(pages):], parent if copied else None)
                pool.release(held + ([] if copied else blocks[: len(pages)]))
            finally:
                pages.release()
        discarded = []
        for request, pages, num_hits in list(self._reading.values()):
            if not pages.fresh() or request.block_table[num_hits : num_hits + len(pages)] != pages.blocks:
                self._discard(request, reuse=False)  # pins too old (LAND_WITHIN_S; the table check: a safeguard)
                discarded.append(request)
            elif not pages.intact():  # not in the last step, or it would have been settled
                self._discard(request)
                discarded.append(request)
            else:
                try:
                    pages.land(pool.arena.all_blocks)
                    end = max(num_hits + len(pages), request.num_cached_pages)
                    keys = request.page_keys(end)
                    request.block_table[num_hits:end] = self.tables.index_blocks(
                        request.block_table[num_hits:end], keys[num_hits:], keys[num_hits - 1] if num_hits else None)
                finally:
                    self._drop(request)
        return discarded

    def stash(self, request: Request) -> None:
        """A request giving its blocks up (finished after its first token, preempted, aborted) leaves
        its pages read in place, and those its step filled after them, to the next step, its blocks
        held by a reference of their own: they are copied and cached all the same, so a prompt
        answered in one token still warms the local cache."""
        entry = self._reading.pop(id(request), None)
        if entry is None:
            return
        _, pages, num_hits = entry
        end = max(num_hits + len(pages), request.num_cached_pages)
        blocks = request.block_table[num_hits:end]
        if num_hits < request.num_released_blocks or blocks[: len(pages)] != pages.blocks:
            pages.release()  # not the request's blocks any more (never so: a safeguard)
            return
        keys = request.page_keys(end)
        self.tables.pool.ref(blocks)  # the landing's own references, dropped once the pages are cached
        self._landing.append((pages, blocks, keys[num_hits:], keys[num_hits - 1] if num_hits else None))

    def _discard(self, request: Request, reuse: bool = True) -> None:
        """A request whose pages read in place are altered computes its prompt without them,
        reusing those before the altered one; with `reuse` False (their pins too old:
        LAND_WITHIN_S), none of them. The scheduler then sends it back to wait."""
        _, pages, num_hits = self._reading[id(request)]
        intact = pages.num_intact() if reuse else 0
        if not reuse:
            log.warning("pages of request %s read in place were held past %.0f s; computing its prompt without "
                        "them", request.request_id, LAND_WITHIN_S)
        else:
            log.warning("pages of request %s read in place failed their check at page %d of %d (altered, or not "
                        "checked in time); computing its prompt from there", request.request_id, intact, len(pages))
        if intact:  # cached, so the recompute reuses them
            pages.land(self.tables.pool.arena.all_blocks, intact)
            self.tables.index_pages(request, num_hits, num_hits + intact)
        self._drop(request)
        request.remote_given_up = True
        if request.cached_tokens_remote:  # set by the join: what it will reuse, as a layer-wise discard says
            P = self.tables.page_tokens
            request.cached_tokens_local, request.cached_tokens_remote = (
                (num_hits * P, intact * P) if intact else (None, None))
        self.num_discarded += 1

    def _drop(self, request: Request) -> None:
        """Give a request's pages read in place back to the node, uncopied."""
        entry = self._reading.pop(id(request), None)
        if entry is not None:
            entry[1].release()
