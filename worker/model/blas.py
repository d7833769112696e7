"""How many BLAS threads a forward uses.

Measured on the 2-core box this project runs on, with another process busy on one core (the
normal case in a local cluster: kvnodes, coordinator and worker share the cores): a [8, 768] x
[768, 3072] matmul took ~20 ms with OpenBLAS's 2 threads and ~2 ms with 1, because the second
thread waits for a core. From ~64 rows up, two threads pay off for the weight matmuls. So
forwards of few rows (decode steps, short prefill chunks) run single-threaded; larger ones keep
the default. Attention's matmuls are per head and small (a 512-token causal prefill over 12
heads: 150-220 ms on one thread against 0.5-2 s on two, same load), so attention always runs
on one thread.

With invariant numerics (worker/model/invariant.py) BLAS always runs on one thread: a weight
product is many calls of 64 columns each, and OpenBLAS's threads, woken for each call, waited
for a busy core each time (3.7x slower than one thread at 512 rows, the other core busy). A large
product instead splits its panels between `split_workers` Python threads, one wait per product.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

SINGLE_THREAD_MAX_ROWS = 48

_controller = None   # threadpoolctl inspects the loaded libraries once (a few ms); reused after
_forced = False      # inside forced_threads(): forwards leave the thread count alone
_forced_count = 0    # forced_threads' count
_cap = None          # cap_threads' count; None: one per core


def threads_for_rows(rows: int, invariant: bool = False) -> AbstractContextManager:
    """Context in which BLAS runs with the thread count suited to a forward of `rows` tokens
    (one thread with invariant numerics: see the module's docstring)."""
    if invariant:
        return single_thread()
    if rows > SINGLE_THREAD_MAX_ROWS or _forced:
        return nullcontext()
    return single_thread()


def attention_threads(rows: int, invariant: bool = False) -> AbstractContextManager:
    """Context for the attention of a forward of `rows` tokens: one BLAS thread. A small forward
    already runs on one, and setting it again each layer costs ~15 us per call."""
    if rows > SINGLE_THREAD_MAX_ROWS and not _forced and not invariant:   # invariant: already one thread
        return single_thread()
    return nullcontext()


def split_workers(rows: int) -> int:
    """Python threads an invariant weight product of `rows` rows splits its panels between: as many
    as BLAS would have run threads for that forward."""
    if _forced:
        return _forced_count
    if rows <= SINGLE_THREAD_MAX_ROWS:
        return 1
    return _cap or os.cpu_count() or 1


@contextmanager
def forced_threads(count: int) -> Iterator[None]:
    """Every forward inside runs on `count` BLAS threads, whatever its rows: for a bench that
    compares thread counts (`kvcache bench forward --threads`), not for serving."""
    global _forced
    if count < 1:
        raise ValueError(f"BLAS threads must be at least 1, got {count}")
    global _forced_count
    with _blas_controller().limit(limits=count, user_api="blas"):
        _forced, _forced_count = True, count
        try:
            yield
        finally:
            _forced = False


def single_thread() -> AbstractContextManager:
    return _blas_controller().limit(limits=1, user_api="blas")


def cap_threads(count: int) -> None:
    """Cap BLAS at `count` threads for the rest of the process: a worker that shares the cores
    with other workers must not run one thread per core (two workers prefilling side by side on
    two cores were ~6x slower with a thread per core each than with one). Forwards of few rows
    still drop to one thread; when they end, BLAS returns to this cap."""
    global _cap
    if count < 1:
        raise ValueError(f"BLAS threads must be at least 1, got {count}")
    _blas_controller().limit(limits=count, user_api="blas")  # stays in force: never restored
    _cap = count


def _blas_controller():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller
