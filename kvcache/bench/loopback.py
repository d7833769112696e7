"""The raw baseline every transfer bench is measured against: a loopback TCP socket to a
separate process that sends (get) or swallows (put) the requested bytes, with no framing
beyond a 9-byte header. Nothing over loopback moves bytes faster from Python."""

from __future__ import annotations

import multiprocessing
import socket
import struct

import numpy as np

_HEADER = struct.Struct("!cQ")


class SocketBaseline:
    """A connected loopback socket to a sink process; `stop()` (or the context) ends the process by its pid."""

    def __init__(self, timeout_s: float = 30.0):
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Queue()
        self._sink = ctx.Process(target=_serve, args=(ready,), daemon=True)
        self._sink.start()
        try:
            port = ready.get(timeout=timeout_s)
            self._sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(None)  # blocking, as a plain socket client would be: no poll before each recv
        except BaseException:
            self._stop_sink()
            raise
        self._ack = memoryview(bytearray(1))

    def get(self, out: np.ndarray) -> None:
        """Receive out.nbytes bytes into `out` (C-contiguous)."""
        view = memoryview(out).cast("B")
        self._sock.sendall(_HEADER.pack(b"G", view.nbytes))
        recv_exactly(self._sock, view)

    def put(self, pages: np.ndarray) -> None:
        """Send the bytes of `pages` and wait for the sink's one-byte acknowledgement."""
        view = memoryview(pages).cast("B")
        self._sock.sendall(_HEADER.pack(b"P", view.nbytes))
        self._sock.sendall(view)
        recv_exactly(self._sock, self._ack)

    def stop(self) -> None:
        self._sock.close()
        self._stop_sink()

    def _stop_sink(self) -> None:
        self._sink.terminate()
        self._sink.join(5)

    def __enter__(self) -> "SocketBaseline":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("socket closed mid-transfer")
        got += n


def _serve(ready) -> None:
    """The sink process: one connection; sends (G) or swallows (P) the requested bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    ready.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray()
    header = memoryview(bytearray(_HEADER.size))
    while True:
        try:
            recv_exactly(conn, header)
        except (ConnectionError, OSError):
            return
        op, length = _HEADER.unpack(header)
        if len(buffer) < length:
            buffer = bytearray(length)
        view = memoryview(buffer)[:length]
        if op == b"G":
            conn.sendall(view)
        else:
            recv_exactly(conn, view)
            conn.sendall(b"k")
