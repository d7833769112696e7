"""Redis as a transfer baseline: a private `redis-server` on loopback (no persistence), driven
by redis-py with the hiredis parser, the way a KV-cache store on Redis would be used.

A batch is one round trip: a get is one MGET, a put one pipeline of SETs (no transaction).
Of MGET/pipelined GETs and MSET/pipelined SETs these were the faster ones here, by 5-20%.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import Sequence

import numpy as np

INSTALL_HINT = "run make bench-deps"


def why_unavailable(server: str = "redis-server") -> str | None:
    """None when a Redis baseline can run here, else the reason, with how to fix it."""
    if shutil.which(server) is None:
        return f"{server} not installed: {INSTALL_HINT}"
    try:
        import redis  # noqa: F401
    except ImportError:
        return f"the redis package is not installed: {INSTALL_HINT}"
    return None


def versions(server: str = "redis-server") -> dict[str, str | bool]:
    """Versions of the server, redis-py and hiredis, for the bench's JSON."""
    found: dict[str, str | bool] = {}
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE

        found["redis_py"] = redis.__version__
        found["hiredis_parser"] = bool(HIREDIS_AVAILABLE)
    except ImportError:
        pass
    try:
        import hiredis

        found["hiredis"] = hiredis.__version__
    except ImportError:
        pass
    if shutil.which(server):
        out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=10).stdout
        found["redis_server"] = out.strip()
    return found


class RedisBaseline:
    """A `redis-server` child on 127.0.0.1 and a client to it; `stop()` ends the child by its pid."""

    def __init__(self, server: str = "redis-server", max_memory_bytes: int = 0, timeout_s: float = 15.0):
        import redis

        self._dir = tempfile.TemporaryDirectory(prefix="kvcache-redis-")
        self.port = _free_port()
        command = [
            server, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self._dir.name,
            "--save", "", "--appendonly", "no",  # a cache: no persistence
            "--maxmemory", str(max_memory_bytes), "--maxmemory-policy", "allkeys-lru",
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        stdin=subprocess.DEVNULL)
        try:
            self.client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=60)
            _wait_ready(self.client, self.process, timeout_s)
        except BaseException:
            self.stop()
            raise

    def get(self, keys: Sequence[bytes], out: np.ndarray) -> None:
        """One MGET; each value is copied into its row of `out`, as the node client fills its array."""
        values = self.client.mget(keys)
        for row, value in enumerate(values):
            if value is None:
                raise RuntimeError(f"redis lost key {keys[row]!r}")
            out[row] = np.frombuffer(value, dtype=np.uint8)

    def put(self, keys: Sequence[bytes], pages: np.ndarray) -> None:
        """One pipeline of SETs; rows go out as memoryviews (redis-py sends large values without copying)."""
        pipe = self.client.pipeline(transaction=False)
        for key, row in zip(keys, pages):
            pipe.set(key, memoryview(row))
        pipe.execute()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self._dir.cleanup()

    def __enter__(self) -> "RedisBaseline":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(client, process: subprocess.Popen, timeout_s: float) -> None:
    import redis

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if process.poll() is not None:
                raise RuntimeError(f"redis-server exited with code {process.returncode} (port taken?)") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer within {timeout_s:.0f}s") from None
            time.sleep(0.05)
