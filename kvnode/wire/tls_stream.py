"""TLS over a plain blocking socket through memory BIOs, for both ends of the data plane
(kvnode/data_plane/server.py, kvnode/client/data_client.py; framing: data_frames.py).

Why not an ssl.SSLSocket: it reads one 16 KiB record per call in two syscalls, writes each record
with a syscall of its own, and needs a socket timeout (a poll before each call), since over a
kernel timeout it would retry forever. Those syscalls, not the cipher, were most of TLS's cost
(docs/benchmarks.md).
"""

from __future__ import annotations

import socket
import ssl
import time

from kvnode.wire.data_frames import send_within, set_kernel_timeouts

# Bytes of TLS records read from the socket at once, a buffer per stream (64 MiB on a node at its
# default 64 connections, all TLS); OpenSSL gives one record a read, so a recv_into drains them all.
TLS_READ_CHUNK = 1 << 20
TLS_SEND_BATCH = 256 << 10  # parts after the first are encrypted into one send while below this


class TlsStream:
    """TLS over a plain blocking socket through memory BIOs, for both ends: the socket keeps its
    kernel timeouts, one recv brings up to a MiB of records, each decrypted straight into the
    caller's buffer, and each part sent (with the small ones after it) is encrypted whole and
    written at once (sendall, or within `deadline`), not one syscall a 16 KiB record as an
    ssl.SSLSocket does. The handshake checks certificates as the context says, as wrap_socket
    would, within `deadline`. Offers what the data plane uses of a socket."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server_side: bool = False,
                 server_hostname: str | None = None, deadline: float | None = None):
        self.sock = sock
        # A kernel timeout bounds one socket call, not a loop of them: a peer trickling a byte at a time
        # could stretch a handshake, a record or a send without end. So with a deadline (monotonic)
        # every socket call ends by then, or socket.timeout; None: kernel timeouts only.
        self.deadline = deadline
        self._incoming, self._outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._chunk = bytearray(TLS_READ_CHUNK)
        self._chunk_view = memoryview(self._chunk)
        while True:
            try:
                self._tls.do_handshake()  # certificate checks as wrap_socket's (the context's)
                break
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    raise ConnectionResetError("closed during the TLS handshake") from None
            except ssl.SSLError:
                try:
                    self._flush()  # the alert that tells the peer why
                except OSError:
                    pass
                raise
        self._flush()
        self.deadline = None

    def _limit(self) -> None:
        """The next recv's kernel timeout: what is left of the deadline. It changes the socket's
        receive timeout: whoever sets a deadline sets it back."""
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("the TLS stream's deadline passed")
            set_kernel_timeouts(self.sock, left, send=False)

    def _flush(self) -> None:
        if not self._outgoing.pending:
            return
        if self.deadline is None:
            self.sock.sendall(self._outgoing.read())
            return
        data = memoryview(self._outgoing.read())
        while data:  # sendall's loop, within the deadline
            data = data[send_within(self.sock, [data], self.deadline):]

    def _fill(self) -> bool:
        """More records from the socket; False at its end."""
        self._limit()
        n = self.sock.recv_into(self._chunk)
        if n == 0:
            self._incoming.write_eof()
            return False
        self._incoming.write(self._chunk_view[:n])
        return True

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        """Up to nbytes (all of `buffer` when 0) bytes: every record already received that fits,
        so one call a socket read, not one a 16 KiB record; blocks only when none
        is there. 0 once the peer closed."""
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        size = min(nbytes, view.nbytes) if nbytes else view.nbytes
        read, got = self._tls.read, 0
        while got < size:
            try:
                n = read(size - got, view[got:] if got else view)
                if n == 0:  # close_notify: the end of the stream
                    break
                got += n
            except ssl.SSLWantReadError:
                self._flush()  # a post-handshake message may want an answer before we wait
                if got:
                    return got
                if not self._fill():
                    return 0
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                break  # the end of the stream (a later call returns 0)
        self._flush()
        return got

    def sendmsg(self, parts) -> int:
        """The first part encrypted whole, and the next ones while less than TLS_SEND_BATCH bytes
        are encrypted, sent as one write (within self.deadline when set); their size (send_parts
        then checks its deadline before the next call). So a reply's header goes with its first
        page, and the small slices of a banded GET go a few hundred KiB a syscall, not one each."""
        write, sent = self._tls.write, 0
        for part in parts:
            sent += write(part)
            if sent >= TLS_SEND_BATCH:
                break
        self._flush()
        return sent

    def sendall(self, data) -> None:
        self._tls.write(data)
        self._flush()

    def getpeercert(self):
        return self._tls.getpeercert()

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
