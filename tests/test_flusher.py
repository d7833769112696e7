"""The flusher (kvnode/store/flusher.py) writes dirty pages on its own thread every interval; an
unexpected failure of a flush (a bug, not the disk's OSError) is logged once with its reason and
the thread keeps flushing, rather than dying silently with the node's pages left unwritten."""

from __future__ import annotations

import logging
import time

from kvnode.disk.tier import DiskTier
from kvnode.store.flusher import Flusher
from kvnode.store.page_store import PageStore, PutOutcome
from store_helpers import key, page

PAGE_BYTES = 64


def test_an_unexpected_failure_is_logged_once_and_the_flusher_keeps_flushing(tmp_path, caplog):
    store = PageStore(2, PAGE_BYTES, disk=DiskTier(tmp_path, 8, PAGE_BYTES))
    assert store.put(key(1), b"", page(1, PAGE_BYTES)) == PutOutcome.STORED
    flush, calls = store.flush, []

    def failing_three_times() -> int:
        calls.append(None)
        if len(calls) <= 3:
            raise RuntimeError("a bug in a flush")
        return flush()

    store.flush = failing_three_times
    flusher = Flusher(store, 0.01).start()
    deadline = time.monotonic() + 10.0
    while store.num_dirty() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert store.num_dirty() == 0, "the flusher stopped flushing"
        assert flusher._thread.is_alive()
    finally:
        store.flush = flush
        flusher.stop()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info[0] is RuntimeError, [r.getMessage() for r in errors]
