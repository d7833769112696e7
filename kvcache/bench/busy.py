"""Busy processes beside a bench (`kvcache bench chaos --load N`): each multiplies matrices on one
BLAS thread, as another worker would, so the cluster runs on a machine short of cores and cache.
Each ends by itself after a bound and is killed by its pid when the bench ends."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Iterator

_LOOP = """
import sys, time
import numpy as np
end = time.monotonic() + float(sys.argv[1])
a = np.random.default_rng(0).standard_normal((384, 384), dtype=np.float32)
while time.monotonic() < end:
    for _ in range(20):
        b = a @ a
    a = b / np.abs(b).max()
"""


@contextlib.contextmanager
def busy_processes(count: int, bound_s: float) -> Iterator[list[int]]:
    """`count` busy processes for the block's duration (each stops by itself after `bound_s`); their pids."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _LOOP, str(bound_s)], env=env, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


def running(pids: list[int]) -> list[int]:
    """Those of `pids` still running the busy loop (not a process that reused the number)."""
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"np.random.default_rng(0).standard_normal((384, 384)" in f.read():
                    left.append(pid)
        except OSError:
            pass
    return left
