"""How many BLAS threads a forward uses.

Measured on the 2-core box this project runs on, with another process busy on one core (the
normal case in a local cluster: kvnodes, coordinator and worker share the cores): a [8, 768] x
[768, 3072] matmul took ~20 ms with OpenBLAS's 2 threads and ~2 ms with 1, because the second
thread waits for a core. From ~64 rows up, two threads pay off for the weight matmuls. So
forwards of few rows (decode steps, short prefill chunks) run single-threaded; larger ones keep
the default. Attention's matmuls are per head and small (a 512-token causal prefill over 12
heads: 150-220 ms on one thread against 0.5-2 s on two, same load), so attention always runs
on one thread.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterator

SINGLE_THREAD_MAX_ROWS = 48

_controller = None   # threadpoolctl inspects the loaded libraries once (a few ms); reused after
_forced = False      # inside forced_threads(): forwards leave the thread count alone


def threads_for_rows(rows: int) -> AbstractContextManager:
    """Context in which BLAS runs with the thread count suited to a forward of `rows` tokens."""
    if rows > SINGLE_THREAD_MAX_ROWS or _forced:
        return nullcontext()
    return single_thread()


def attention_threads(rows: int) -> AbstractContextManager:
    """Context for the attention of a forward of `rows` tokens: one BLAS thread. A small forward
    already runs on one, and setting it again each layer costs ~15 us per call."""
    if rows > SINGLE_THREAD_MAX_ROWS and not _forced:
        return single_thread()
    return nullcontext()


@contextmanager
def forced_threads(count: int) -> Iterator[None]:
    """Every forward inside runs on `count` BLAS threads, whatever its rows: for a bench that
    compares thread counts (`kvcache bench forward --threads`), not for serving."""
    global _forced
    if count < 1:
        raise ValueError(f"BLAS threads must be at least 1, got {count}")
    with _blas_controller().limit(limits=count, user_api="blas"):
        _forced = True
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
    if count < 1:
        raise ValueError(f"BLAS threads must be at least 1, got {count}")
    _blas_controller().limit(limits=count, user_api="blas")  # stays in force: never restored


def _blas_controller():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller
