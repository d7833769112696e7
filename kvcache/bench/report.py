"""Shared bench output: latency summaries, a plain table, JSON with the machine and versions."""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Sequence

import numpy as np


def latency_summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    values = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {
        "p50_ms": float(np.percentile(values, 50)),
        "p99_ms": float(np.percentile(values, 99)),
        "mean_ms": float(values.mean()),
    }


def rotated_order(transports: list[str], round_index: int, ops: Sequence[str] = ("get", "put")) -> list[tuple[str, str]]:
    """This round's (transport, op) order for interleaved transfer benches: every get, then every
    put, each list rotated by the round, so each transport takes each place equally often
    (whichever runs first after the puts was seen to pay for them)."""
    shift = round_index % len(transports)
    turn = transports[shift:] + transports[:shift]
    return [(t, op) for op in ops for t in turn]


def machine() -> dict[str, object]:
    import grpc

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "numpy": np.__version__,
        "grpcio": grpc.__version__,
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], out=sys.stdout) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=out)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def dump_json(result: dict, out=sys.stdout) -> None:
    json.dump(result, out, indent=2, sort_keys=True)
    print(file=out)


def progress(items: Sequence, label: str, out=None):
    """Yield `items`, showing `label: done/total` on `out` (stderr): rewritten in place on a terminal, a line each elsewhere."""
    out = out or sys.stderr
    total = len(items)
    in_place = out.isatty()
    for done, item in enumerate(items):
        yield item
        end = "" if in_place and done + 1 < total else "\n"
        print(f"{chr(13) if in_place else ''}{label}: {done + 1}/{total}", end=end, file=out, flush=True)


def versions() -> dict[str, str]:
    """Versions of kvcache and of the libraries a bench's figures depend on ("absent" when not installed)."""
    from importlib import metadata

    found = {}
    for name in ("kvcache", "numpy", "grpcio", "protobuf", "matplotlib", "rich"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "absent"
    return found


MATPLOTLIB_MISSING = "matplotlib is not installed: install the bench extra (pip install -e '.[bench]') to draw charts"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend; ImportError with MATPLOTLIB_MISSING when not installed."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Progress:
    """A progress bar on stderr (rich, when installed and stderr is a terminal), else a plain line per ~10%.

    with Progress("cache pass", total=80) as bar: ... bar.advance()
    """

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label = label
        self.total = max(1, total)
        self.enabled = enabled
        self.done = 0
        self._next_line = 0
        self._rich = None

    def __enter__(self) -> "Progress":
        if self.enabled and sys.stderr.isatty():
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TimeElapsedColumn

                self._rich = RichProgress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                          console=Console(stderr=True), transient=True)
                self._rich.start()
                self._task = self._rich.add_task(self.label, total=self.total)
            except ImportError:
                self._rich = None
        return self

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=self.done)
        elif self.done >= self._next_line or self.done >= self.total:
            print(f"{self.label}: {self.done}/{self.total}", file=sys.stderr, flush=True)
            self._next_line = self.done + max(1, self.total // 10)

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.stop()
