"""TlsStream (kvnode/wire/tls_stream.py) on its own, over a socket pair: a receive
takes every record already there, stops short when asked, and a peer that closes, cleanly
or mid-record, ends the stream without a hang."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest

from base import security
from kvnode.wire import data_frames as dw
from kvnode.client.data_client_io import DataPlaneError, receive
from kvnode.wire.tls_stream import TlsStream

RECORD = 16384  # a TLS record's most plaintext


@pytest.fixture
def pair(certs):
    """(client TlsStream, server TlsStream, the server's raw socket), mutual TLS done."""
    a, b = socket.socketpair()
    for sock in (a, b):
        dw.set_kernel_timeouts(sock, 5.0)
    server_context = security.Credentials(certs / "ca.pem", certs / "node.pem", certs / "node.key").server_context()
    client_context = security.Credentials(certs / "ca.pem", certs / "worker.pem", certs / "worker.key").client_context()
    made = {}
    thread = threading.Thread(target=lambda: made.setdefault("server", TlsStream(b, server_context, server_side=True)))
    thread.start()
    client = TlsStream(a, client_context, server_hostname="localhost")
    thread.join(5)
    yield client, made["server"], b
    a.close()
    b.close()


def pattern(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


def send_on_a_thread(server, data) -> threading.Thread:
    thread = threading.Thread(target=server.sendall, args=(data,))
    thread.start()
    return thread


def test_a_reply_of_many_records_lands_whole_in_fewer_calls_than_records(pair):
    client, server, _ = pair
    data = pattern(64 * RECORD + 1000)
    sender = send_on_a_thread(server, data)
    out = bytearray(len(data))
    view, got, calls = memoryview(out), 0, 0
    while got < len(out):
        n = client.recv_into(view[got:])
        assert n > 0
        got, calls = got + n, calls + 1
    sender.join(5)
    assert bytes(out) == data
    assert calls < 65  # records already received are decrypted in the same call


def test_a_short_read_takes_what_is_asked_and_leaves_the_rest_for_the_next(pair):
    client, server, _ = pair
    data = pattern(3 * RECORD)
    send_on_a_thread(server, data).join(5)
    out = bytearray(len(data))
    assert client.recv_into(out, 100) == 100  # part of the first record
    assert client.recv_into(memoryview(out)[100:], RECORD) == RECORD  # the rest of it and part of the next
    view, got = memoryview(out), 100 + RECORD
    while got < len(out):
        got += client.recv_into(view[got:])
    assert bytes(out) == data


def test_a_receive_into_a_buffer_of_another_format_counts_bytes(pair):
    client, server, _ = pair
    send_on_a_thread(server, pattern(4000)).join(5)
    out = memoryview(bytearray(4000)).cast("I")  # 1000 items of 4 bytes, one record on the wire
    assert client.recv_into(out) == 4000
    assert bytes(out) == pattern(4000)


def test_a_peer_that_closes_cleanly_ends_the_stream_after_its_last_byte(pair):
    client, server, raw = pair
    server.sendall(pattern(RECORD + 10))
    with pytest.raises(ssl.SSLWantReadError):
        server._tls.unwrap()  # our close_notify, then it would wait for the peer's
    server._flush()
    raw.shutdown(socket.SHUT_WR)
    out = bytearray(2 * RECORD)
    view, got = memoryview(out), 0
    while (n := client.recv_into(view[got:])) > 0:
        got += n
    assert got == RECORD + 10 and bytes(out[:got]) == pattern(RECORD + 10)
    assert client.recv_into(out) == 0  # and stays ended


def test_a_peer_that_closes_mid_record_fails_the_receive_with_what_arrived(pair):
    client, server, raw = pair
    server.sendall(pattern(1000))  # one whole record
    server._tls.write(pattern(RECORD))
    record = server._outgoing.read()
    raw.sendall(record[: len(record) // 2])  # half of the next one, then gone
    raw.shutdown(socket.SHUT_WR)
    out = memoryview(bytearray(1000 + RECORD))
    with pytest.raises(DataPlaneError, match="closed after 1000 of 17384 bytes"):
        receive(client, out, deadline=float("inf"))
    assert bytes(out[:1000]) == pattern(1000)


def receive_all(client, size: int) -> bytes:
    out = memoryview(bytearray(size))
    receive(client, out, deadline=float("inf"))
    return bytes(out)


def test_send_parts_over_tls_sends_many_small_parts_in_few_calls_and_in_order(pair):
    client, server, _ = pair
    parts = [bytes([i % 251]) * 19_661 for i in range(480)]  # 16 pages x 30 bands of a banded GET
    parts[7] = b""
    calls = []
    sendmsg = server.sendmsg
    server.sendmsg = lambda chunk: calls.append(len(chunk)) or sendmsg(chunk)
    sender = threading.Thread(target=dw.send_parts, args=(server, parts, None))
    sender.start()
    assert receive_all(client, sum(map(len, parts))) == b"".join(parts)
    sender.join(5)
    assert len(calls) < len(parts) // 10  # a few hundred KiB a call, not one part each


def test_a_small_first_part_goes_in_one_send_with_the_next(pair):
    client, server, _ = pair
    page = pattern(589_824)
    sent = []
    sender = threading.Thread(target=lambda: sent.append(server.sendmsg([b"header", page, page])))
    sender.start()
    assert receive_all(client, 6 + len(page)) == b"header" + page
    sender.join(5)
    assert sent == [6 + len(page)]  # the header and the first page, not the second


def test_a_reader_that_trickles_cannot_stretch_a_send_past_its_deadline(pair):
    """send_parts' deadline holds inside the TLS send loop: every partial send makes progress,
    so no kernel timeout fires, yet the send ends by the deadline (pages stay pinned until then)."""
    client, server, _ = pair
    stop = threading.Event()

    def trickle():  # ~1.6 MB/s of ciphertext: 8 MiB would take ~5 s
        buffer = bytearray(16384)
        while not stop.is_set() and client.sock.recv_into(buffer):
            time.sleep(0.01)

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        with pytest.raises(OSError):  # socket.timeout, or BlockingIOError from the kernel timeout
            dw.send_parts(server, [dw.ok_reply(8 << 20), bytes(8 << 20)], deadline=started + 0.3)
        assert time.monotonic() - started < 1.5
        assert server.deadline is None
    finally:
        stop.set()


def test_a_handshake_trickled_a_byte_at_a_time_ends_at_its_deadline(certs):
    """A kernel timeout bounds one recv; a ClientHello sent a byte every 20 ms never trips it.
    The handshake's deadline does."""
    server_context = security.Credentials(certs / "ca.pem", certs / "node.pem", certs / "node.key").server_context()
    client_context = security.Credentials(certs / "ca.pem", certs / "worker.pem", certs / "worker.key").client_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with pytest.raises(ssl.SSLWantReadError):
        client_context.wrap_bio(incoming, outgoing, server_hostname="localhost").do_handshake()
    hello = outgoing.read()
    a, b = socket.socketpair()
    with a, b:
        def trickle():
            for byte in hello:
                time.sleep(0.02)
                try:
                    a.sendall(bytes([byte]))
                except OSError:
                    return

        threading.Thread(target=trickle, daemon=True).start()
        started = time.monotonic()
        with pytest.raises((socket.timeout, BlockingIOError)):  # the deadline, or the recv timed out at it
            TlsStream(b, server_context, server_side=True, deadline=started + 0.3)
        assert time.monotonic() - started < 1.5
