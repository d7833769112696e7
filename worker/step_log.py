"""`kvcache worker --step-log FILE`: one JSON line per engine step, to see where a request's time
goes (waiting for other steps, its own prefill chunks, decodes riding along).

Each line is the engine's step record: `time` (Unix seconds at the step's start), `schedule_ms`,
`forward_ms`, and per request `id`, `arrived` (Unix seconds), `new` tokens this step, tokens
`computed` before it, `prompt` tokens and the `cached_local` / `cached_remote` ones. A request got
its first token in the step where `computed + new` reaches `prompt`; it waited from `arrived` to
the `time` of its first step. `between_layers` is true for a step run in a pause of another
(a newcomer computed between the layers of a long prompt's chunk): it is logged before that
step, whose `forward_ms` includes it.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

log = logging.getLogger("worker")


class StepLog:
    """Appends step records to a file; a write that fails turns the log off with one line."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # line-buffered: readable while running
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            except OSError as exc:
                log.warning("step log %s: %s; no more steps are logged", self.path, exc.strerror or exc)
                self._file.close()
                self._file = None

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
