"""Start a kvcache daemon as a child process and learn its address from the line it prints.

Every daemon prints "... listening on HOST:PORT ..." once it serves; with --port 0 that
line is the only way to know the port. Used by benches, `cluster up` and tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Sequence

_LISTENING = re.compile(r"listening on (\S+:\d+)")


class DaemonFailed(RuntimeError):
    pass


class Daemon:
    """A running `kvcache <role> ...` child; `stop()` ends it by its own pid."""

    def __init__(self, role: str, args: Sequence[str], log_path: Path | None = None, timeout_s: float = 30.0, env=None):
        self.role = role
        self.log_path = log_path
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvcache.cli", role, *args],
                stdout=subprocess.PIPE,
                stderr=log,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # Ctrl-C in the parent's terminal does not reach it; we stop it ourselves
            )
        finally:
            if log_path:
                log.close()
        self.pid = self.process.pid
        self.address = self._read_address(timeout_s)

    def _read_address(self, timeout_s: float) -> str:
        found: list[str] = []
        lines: list[str] = []

        def read() -> None:
            for raw in self.process.stdout:
                line = raw.decode(errors="replace").rstrip()
                lines.append(line)
                match = _LISTENING.search(line)
                if match:
                    found.append(match.group(1))
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.stop()
            where = f"; see {self.log_path}" if self.log_path else ""
            raise DaemonFailed(
                f"kvcache {self.role} did not start within {timeout_s:.0f}s "
                f"(exit code {self.process.returncode}, printed {lines[-3:]}){where}"
            )
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in self.process.stdout], daemon=True).start()
        return found[0]

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns the exit code."""
        if self.process.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(5.0)
            except ProcessLookupError:
                pass
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.process.wait(5.0)

    def __enter__(self) -> "Daemon":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
