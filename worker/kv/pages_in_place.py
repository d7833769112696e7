"""Fetched pages read where they lie: a same-host kvnode's pool, mapped into the worker's block
arena (worker/kv/block_arena.py), holds the pages pinned for one step, so a warm request's first
forward reads its prefix without copying it first. Why: copying the pages out of the node's pool
and checking them before the forward was a large share of a warm request's time to first token;
read in place, the fetch is a round trip, and the check runs beside the forward (the runs:
docs/benchmarks-log.md, "Pages read in place").

`InPlaceReader.pin` asks the node (NodeClient.pin_pages) to pin the pages and say their slots. They
stay pinned (the node neither evicts nor rewrites them) until `PagesInPlace.release`, which the
scheduler calls after the request's first step, once it copied them into the request's blocks
(`land`) and indexed them in the local prefix cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np

from worker.kv.block_arena import BlockArena, Window

log = logging.getLogger("worker.remote")

_ATTACH_RETRY_S = 30.0  # after a window could not be made (no room, a failed mapping)
_MAPPING_WAIT_S = 10.0  # how long `prepare` waits for the node's client to map the pool
_MAPPING_SLICE_S = 0.1  # ... in waits this long, so that close() is not held up
CHECK_TIMEOUT_S = 5.0  # the wait for a check (see InPlaceReader._checker), which takes a few ms
# Pins are read or copied from only this soon after they were taken: the node drops a reader's pins
# once its data plane timeout (60 s by default) passes without the release, and may reuse the slots.
LAND_WITHIN_S = 20.0


class PagesInPlace:
    """`len(blocks)` pages meant for `blocks`, lying in arena blocks `arena_blocks` while pinned."""

    def __init__(self, blocks: Sequence[int], arena_blocks: Sequence[int], release: Callable[[], None],
                 checked: Future | None = None):
        self.blocks = list(blocks)
        self.arena_blocks = list(arena_blocks)
        self._release = release
        self._released = False
        self._lock = threading.Lock()
        self._checked = checked  # of the first altered page's index, or None (see InPlaceReader._checker)
        self.pinned_at = time.monotonic()

    def fresh(self) -> bool:
        """Whether the pins are surely still held (LAND_WITHIN_S)."""
        return time.monotonic() - self.pinned_at < LAND_WITHIN_S

    def __len__(self) -> int:
        return len(self.blocks)

    def intact(self, timeout_s: float = CHECK_TIMEOUT_S) -> bool:
        """Whether every page matched its checksum, waiting for the check at most `timeout_s`. The
        scheduler asks after the request's first forward, which read the pages meanwhile, and
        throws that work away if they did not (worker/engine/in_place_joins.py)."""
        return self.num_intact(timeout_s) == len(self.blocks)

    def num_intact(self, timeout_s: float = CHECK_TIMEOUT_S) -> int:
        """How many leading pages matched their checksums (all, or those before the first altered
        one); a check that fails to answer in `timeout_s` trusts none."""
        if self._checked is None:
            return len(self.blocks)
        try:
            altered = self._checked.result(timeout=timeout_s)
        except Exception:  # a timeout, a cancelled or failed check: not trusted
            return 0
        return len(self.blocks) if altered is None else altered

    def land(self, all_blocks: np.ndarray, count: int | None = None) -> None:
        """Copy the first `count` pages (all by default) into their blocks (before release: the
        node may reuse the slots after)."""
        count = len(self.blocks) if count is None else count
        start = 0
        while start < count:
            end = start + 1
            while (end < count and self.blocks[end] == self.blocks[end - 1] + 1
                   and self.arena_blocks[end] == self.arena_blocks[end - 1] + 1):
                end += 1
            into, out_of = self.blocks[start], self.arena_blocks[start]
            np.copyto(all_blocks[into : into + end - start], all_blocks[out_of : out_of + end - start])
            start = end

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Let the node have its pages back (idempotent; never raises)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        try:
            self._release()
        except Exception:  # a release that fails leaves the node to drop the pins at its timeout
            log.exception("releasing pages read in place failed")


class InPlaceReader:
    """Pins pages in same-host nodes' pools and reads them through windows in `arena`."""

    def __init__(self, arena: BlockArena, on_altered: Callable[[str, int, bytes], None] = lambda *_: None):
        self.arena = arena
        self._on_altered = on_altered  # (node address, index, key) of an altered page found by a check
        self._windows: dict[str, tuple] = {}  # node address -> (node, the window of its client's mapping)
        self._attaching: set[str] = set()
        self._retry_at: dict[str, float] = {}
        self._prepare_again: set[str] = set()  # prepared while another attach ran: once it ends
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._attacher = ThreadPoolExecutor(1, thread_name_prefix="kv-window")
        # Every page is checked against its checksum where it lies, as any fetched page is, but on this
        # thread, started as the pages are pinned, so the check runs beside the request's first forward
        # instead of before it (PagesInPlace.intact).
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="kv-check")

    def pin(self, node, keys: Sequence[bytes], block_ids: Sequence[int], timeout: float) -> PagesInPlace | None:
        """`keys`, meant for `block_ids`, pinned in `node`'s pool and readable in the arena; None when
        they cannot be (no window yet, another host, TLS, a page on disk only, another generation
        than the window's): the pages are then fetched into the blocks as before. Raises what
        NodeClient.pin_pages raises."""
        window = self._window(node)
        if window is None:
            return None
        pinned = node.client.pin_pages(keys, timeout=timeout, check=False)  # checked beside the forward (_checker)
        if pinned is None:
            return None
        if pinned.generation != window.generation or not self.arena.pin(window):
            pinned.release()
            self._start_attach(node)  # the node's client mapped another pool: its window replaces this one
            return None

        def release() -> None:
            try:
                pinned.release()
            finally:
                self.arena.unpin(window)

        try:
            checked = self._checker.submit(self._check, node.address, pinned, list(keys))
        except RuntimeError:  # closed
            release()
            return None
        return PagesInPlace(block_ids, [window.first_block + slot for slot in pinned.slots], release, checked)

    def _check(self, address: str, pinned, keys: list[bytes]) -> int | None:
        altered = pinned.first_altered()
        if altered is not None and not pinned.released:  # released meanwhile: the slot may hold another page
            self._on_altered(address, altered, keys[altered])
        return altered

    def prepare(self, node) -> None:
        """Map `node`'s pool into the arena as soon as its client has mapped it, on the attaching
        thread: called at first contact, so no request has to pin to begin it, and none waits for
        the mapping (populating its page tables takes a while). Once per mapping of the node's
        client (its generation); without it the first pin begins the attach."""
        self._start_attach(node, wait_for_mapping=True)

    def attached(self, address: str) -> bool:
        """Whether the pool of the node at `address` is mapped into the arena (for tests and benches)."""
        with self._lock:
            window = self._windows.get(address, (None, None))[1]
        return window is not None and not window.detached

    def attach_now(self, node) -> bool:
        """Map `node`'s pool into the arena now (a bench, before its timed runs), on the attaching
        thread after any attach already asked for; whether it is."""
        try:
            self._attacher.submit(self._attach, node).result()
        except RuntimeError:  # closed
            return False
        return self.attached(node.address)

    def sweep(self) -> None:
        """Unmap the windows of nodes whose client no longer maps that pool (the node stopped, or
        its client was dropped), so a gone node's memory is freed as its client's mapping is."""
        with self._lock:
            windows = list(self._windows.items())
        for address, (node, window) in windows:
            shared = node.client.shared_pool_file()
            if shared is not None:
                os.close(shared.fd)
            if shared is None or shared.generation != window.generation:
                with self._lock:
                    if self._windows.get(address, (None, None))[1] is window:
                        del self._windows[address]
                self.arena.detach(window)

    def _window(self, node) -> Window | None:
        with self._lock:
            window = self._windows.get(node.address, (None, None))[1]
        if window is None or window.detached:
            self._start_attach(node)
            return None
        return window

    def _start_attach(self, node, wait_for_mapping: bool = False) -> None:
        with self._lock:
            if time.monotonic() < self._retry_at.get(node.address, 0.0):
                return
            if node.address in self._attaching:  # a pin's attach may end before the client's mapping: prepare after it
                if wait_for_mapping:
                    self._prepare_again.add(node.address)
                return
            self._attaching.add(node.address)
        try:
            self._attacher.submit(self._attach, node, wait_for_mapping)
        except RuntimeError:  # closed
            with self._lock:
                self._attaching.discard(node.address)

    def _attach(self, node, wait_for_mapping: bool = False) -> None:
        try:
            if wait_for_mapping and not self._client_mapped(node):
                return
            with self._lock:
                current = self._windows.get(node.address, (None, None))[1]
            shared = node.client.shared_pool_file()
            if shared is None or (current is not None and not current.detached
                                  and current.generation == shared.generation):
                if shared is not None:
                    os.close(shared.fd)
                return  # not mapped (yet, or for good): asked again at the next pin
            try:
                window = self.arena.attach(shared.fd, shared.pages, shared.page_bytes, shared.generation)
            finally:
                os.close(shared.fd)
            with self._lock:
                old = self._windows.get(node.address, (None, None))[1]
                self._windows[node.address] = (node, window)
            if old is not None:
                self.arena.detach(old)  # the node restarted: its old window goes once no reader holds it
        except (OSError, ValueError) as exc:
            with self._lock:
                now = time.monotonic()
                self._retry_at = {a: t for a, t in self._retry_at.items() if t > now}  # bounded: due ones go
                self._retry_at[node.address] = now + _ATTACH_RETRY_S
            log.info("pages of kvnode %s are copied, not read in place (%s); tried again in %.0f s",
                     node.address, exc, _ATTACH_RETRY_S)
        except Exception:  # a node client that fails here must not stop later attaches
            log.exception("mapping the pool of kvnode %s into the block arena failed", node.address)
        finally:
            with self._lock:
                self._attaching.discard(node.address)
                again = node.address in self._prepare_again
                self._prepare_again.discard(node.address)
            if again:
                self._start_attach(node, wait_for_mapping=True)

    def _client_mapped(self, node) -> bool:
        """Whether `node`'s client maps its pool, waiting for the mapping it began at first contact
        (at most _MAPPING_WAIT_S, and not past close()), as the client's own state of it says."""
        deadline = time.monotonic() + _MAPPING_WAIT_S
        while True:
            state = node.client.shared_pool_state(wait=_MAPPING_SLICE_S)
            if state == "mapped":
                return True
            if state != "mapping" or self._closing.is_set() or time.monotonic() >= deadline:
                return False  # nothing being mapped (refused, or asked again later), closing, or waited enough

    def close(self) -> None:
        """Stop attaching; windows stay mapped while pages in them are held (BlockArena.detach)."""
        self._closing.set()
        self._attacher.shutdown(wait=True, cancel_futures=True)
        self._checker.shutdown(wait=True)
        with self._lock:
            windows, self._windows = [window for _, window in self._windows.values()], {}
        for window in windows:
            self.arena.detach(window)

