"""Writes a store's dirty pages to its disk tier every `interval_s` seconds, on its own thread,
so a page put in RAM is on disk (synced) at most about one interval later; stop() writes
what is left (the node's SIGTERM). A failed flush is retried at the next interval: the disk's
errors (OSError) are logged each time, any other (a bug) once for each new reason, and the
thread keeps running: dead, it would leave every later put in RAM only, silently."""

from __future__ import annotations

import logging
import math
import threading

from kvnode.store.page_store import PageStore

log = logging.getLogger("kvnode")

DEFAULT_FLUSH_INTERVAL_S = 1.0


def check_flush_interval(seconds: float) -> float:
    """`seconds` as --flush-interval takes it, or ValueError: NaN would never flush, inf never wake."""
    if not 0 <= seconds < math.inf:
        raise ValueError(f"--flush-interval must be a finite number of seconds, 0 or more, got {seconds}")
    return seconds


class Flusher:
    def __init__(self, store: PageStore, interval_s: float):
        self.store = store
        self.interval_s = interval_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="disk-flush", daemon=True)

    def start(self) -> "Flusher":
        self._thread.start()
        return self

    def stop(self) -> int:
        """Stop the thread, then flush once more; pages written by that last flush."""
        self._stopping.set()
        self._thread.join(max(10.0, 2 * self.interval_s))
        return self.store.flush()

    def _run(self) -> None:
        last_reason = None
        while not self._stopping.wait(self.interval_s):
            try:
                self.store.flush()
            except OSError:
                log.exception("writing pages to the disk tier failed; retrying in %.1fs", self.interval_s)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if reason != last_reason:
                    log.exception("flushing to the disk tier failed unexpectedly; the flusher keeps running, "
                                  "retrying every %.1fs, and logs this reason only once", self.interval_s)
                last_reason = reason
