"""The data plane's framing (kvnode/wire/data_frames.py): what one side writes the other reads back,
and a header that is not ours says why."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest

from kvnode.wire import data_frames as dw
from store_helpers import key


def test_a_get_request_round_trips():
    keys = [key(1), key(2), key(3)]
    request = dw.get_request(keys)
    header = dw.parse_request_header(request[: dw.REQUEST.size])
    assert header == dw.RequestHeader(dw.OP_GET, 16, 3, 0)
    assert request[dw.REQUEST.size :] == b"".join(keys)


def test_a_put_request_head_round_trips_roots_children_and_checksums():
    keys, parents, sums = [key(1), key(2)], [b"", key(1)], [b"a" * 16, b"b" * 16]
    head = dw.put_request_head(keys, parents, sums, page_bytes=4096)
    header = dw.parse_request_header(head[: dw.REQUEST.size])
    assert header == dw.RequestHeader(dw.OP_PUT, 16, 2, 4096) and header.checksums
    entries = head[dw.REQUEST.size :]
    assert len(entries) == 2 * dw.put_entry_bytes(16)
    assert dw.parse_put_entries(entries, 2, 16) == [(key(1), b"", sums[0]), (key(2), key(1), sums[1])]


def test_a_version_1_put_carries_no_checksums_and_is_still_read():
    header = dw.parse_request_header(dw.request_header(dw.OP_PUT, 1, page_bytes=64, version=1))
    assert header.version == 1 and not header.checksums
    entry = key(2) + dw.PARENT_LEN.pack(16) + key(1)
    assert dw.parse_put_entries(entry, 1, 16, checksums=False) == [(key(2), key(1), None)]


@pytest.mark.parametrize("code", [grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_reply_headers_round_trip_every_status(code):
    reply = dw.ok_reply(123) if code == grpc.StatusCode.OK else dw.error_reply(code, "page ü is gone")
    status, message_bytes, payload = dw.parse_reply_header(reply[: dw.REPLY.size])
    assert status == code
    if code == grpc.StatusCode.OK:
        assert (message_bytes, payload, len(reply)) == (0, 123, dw.REPLY.size)
    else:
        assert payload == 0 and reply[dw.REPLY.size :].decode("utf-8") == "page ü is gone"
        assert message_bytes == len("page ü is gone".encode("utf-8"))


def test_an_unknown_status_reads_as_unknown():
    assert dw.parse_reply_header(dw.REPLY.pack(200, 0, 0))[0] == grpc.StatusCode.UNKNOWN


@pytest.mark.parametrize(
    "header, fragment",
    [
        (dw.request_header(dw.OP_GET, 1, magic=b"HTTP"), "magic"),
        (dw.request_header(dw.OP_GET, 1, version=9), "version 9"),
        (dw.request_header(7, 1), "unknown data plane op 7"),
    ],
    ids=["magic", "version", "op"],
)
def test_a_foreign_header_is_invalid_argument(header, fragment):
    with pytest.raises(dw.FrameError) as raised:
        dw.parse_request_header(header)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in str(raised.value)


def test_a_parent_of_a_wrong_length_is_invalid_argument():
    entry = bytearray(dw.put_request_head([key(1)], [key(2)], [bytes(16)], 64)[dw.REQUEST.size :])
    entry[16] = 5  # parent_len
    with pytest.raises(dw.FrameError) as raised:
        dw.parse_put_entries(entry, 1, 16)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT and "got 5" in str(raised.value)


def sent_through_a_socketpair(parts) -> bytes:
    """What the other end of a socket pair receives while send_parts sends `parts` on a thread."""
    a, b = socket.socketpair()
    try:
        a.settimeout(5)
        b.settimeout(5)
        expected = sum(memoryview(p).nbytes for p in parts)
        received = bytearray()
        sender = threading.Thread(target=dw.send_parts, args=(a, parts))
        sender.start()
        while len(received) < expected:
            chunk = b.recv(1 << 16)
            assert chunk
            received += chunk
        sender.join(5)
        return bytes(received)
    finally:
        a.close()
        b.close()


def test_send_parts_sends_every_buffer_back_to_back_in_order():
    parts = [b"head", memoryview(bytes(range(256)) * 3000), b"", bytearray(b"tail")]
    assert sent_through_a_socketpair(parts) == b"".join(bytes(p) for p in parts)


def test_send_parts_cuts_long_lists_into_iov_max_calls():
    parts = [bytes([i % 251]) * 7 for i in range(3000)]  # > 2 x the 512 buffers a sendmsg takes
    assert sent_through_a_socketpair(parts) == b"".join(parts)


@pytest.mark.parametrize("timeout_s", [4e-7, 0.0, -1.0])
def test_a_kernel_timeout_too_short_to_count_is_one_millisecond_not_none(timeout_s):
    """send_parts sets what is left of its deadline, which may be under a microsecond or past:
    (0, 0) would be no timeout at all."""
    a, b = socket.socketpair()
    with a, b:
        dw.set_kernel_timeouts(a, timeout_s)
        for option in (socket.SO_SNDTIMEO, socket.SO_RCVTIMEO):
            seconds, micros = struct.unpack("ll", a.getsockopt(socket.SOL_SOCKET, option, 16))
            assert seconds == 0 and 1000 <= micros < 20_000  # the kernel rounds up to its tick


def test_send_parts_on_a_unix_socket_ends_by_its_deadline_for_a_reader_that_trickles():
    """A Unix socket's kernel send timeout bounds each buffer a send waits for, not the call: a
    reader taking 16 KiB every 10 ms kept one send going; the deadline still ends it."""
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        buffer = bytearray(16384)
        while not stop.is_set() and a.recv_into(buffer):
            time.sleep(0.01)

    threading.Thread(target=trickle, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(socket.timeout):
            dw.send_parts(b, [dw.ok_reply(8 << 20), bytes(8 << 20)], deadline=started + 0.3)
        assert time.monotonic() - started < 1.5
    finally:
        stop.set()
        a.close()
        b.close()
