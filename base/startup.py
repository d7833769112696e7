"""What the four daemons do alike at start: their log format, how a refused start ends, and the
signals a gRPC daemon answers (stop, reload certificates) with its warning when it listens in
plaintext beyond loopback."""

from __future__ import annotations

import logging
import sys
import threading

from base import security, serving


def log_to_stderr() -> None:
    """One line per event on stderr: time, source, level, message."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def refuse(command: str, exc: BaseException) -> int:
    """A start refused for a reason the user can fix: one line naming it, exit status 2."""
    print(f"kvcache {command}: error: {exc}", file=sys.stderr)
    return 2


def answer_signals(host: str, credentials, log: logging.Logger) -> threading.Event:
    """SIGTERM and SIGINT set the returned event, SIGHUP reloads the certificates; installed
    before the listening line, so a supervisor's early SIGTERM still stops gracefully."""
    stopping = serving.stop_on_signals()
    security.reload_on_sighup(credentials)
    security.warn_if_exposed(host, credentials, log)
    return stopping
