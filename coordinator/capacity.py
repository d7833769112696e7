"""How many Generate streams a coordinator relays at once, and the threads its server needs.

Every relayed stream holds a handler thread for its whole length. The server gets that many
threads plus a reserve, so Register, Heartbeat, ClusterStatus and health are answered at
once however many streams run (a member whose beats go unanswered is marked dead). A stream
beyond the bound is refused at once, never queued.
"""

from __future__ import annotations

import threading
import time

from base.log_limits import CountedEvent

DEFAULT_MAX_STREAMS = 256
CONTROL_THREADS = 16  # never taken by a stream: membership, status, health, reflection
REFUSAL_LOG_INTERVAL_S = 10.0


def server_threads(max_streams: int) -> int:
    return max_streams + CONTROL_THREADS


class StreamSlots:
    """A non-blocking count of running streams, bounded by `limit`."""

    def __init__(self, limit: int, clock=time.monotonic):
        if limit < 1:
            raise ValueError(f"the stream limit must be at least 1, got {limit}")
        self.limit = limit
        self._in_use = 0
        self._refusals = CountedEvent(REFUSAL_LOG_INTERVAL_S, clock)
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self._in_use >= self.limit:
                self._refusals.happened()
                return False
            self._in_use += 1
            return True

    def release(self) -> None:
        with self._lock:
            assert self._in_use > 0, "released a stream slot that was not taken"
            self._in_use -= 1

    def in_use(self) -> int:
        return self._in_use

    def take_refusals_to_log(self) -> int:
        """Refusals since the last log line, at most one line per REFUSAL_LOG_INTERVAL_S (0: do not log now)."""
        return self._refusals.to_log()
