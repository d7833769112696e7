"""Events that may come by the hundred, logged as one line per interval with their count.

A flood of connections over a bound is one event to an operator, not hundreds of lines: 200
clients against a kvnode's 64 data plane connections wrote 394 refusal lines in two seconds.
The first one is logged at once; those within the next interval are counted and said with the
next line due (the next such event after the interval).
"""

from __future__ import annotations

import threading
import time

DEFAULT_INTERVAL_S = 10.0


class CountedEvent:
    """Counts an event and says when a line is due: `happened()` on each (or `happened(n)` for n at
    once), `to_log()` for the count to put in a line now (0: stay silent), at most one line per
    `interval_s`."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._unlogged = 0
        self._last_line = float("-inf")
        self._lock = threading.Lock()

    def happened(self, count: int = 1) -> None:
        with self._lock:
            self._unlogged += count

    def to_log(self) -> int:
        """Events since the last line, when a line is due; 0 otherwise (none, or within the interval)."""
        with self._lock:
            now = self.clock()
            if not self._unlogged or now - self._last_line < self.interval_s:
                return 0
            count, self._unlogged, self._last_line = self._unlogged, 0, now
            return count
