"""kvnode.wire frames PageChunk and PutItem by hand: it must stay byte-compatible with
the protobuf classes both ways, and a malformed buffer raises MalformedMessage only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvnode.wire import grpc_frames as wire
from protos import kvcache_pb2 as pb

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
blobs = st.binary(max_size=400)  # crosses the one- and two-byte length prefixes
keys = st.one_of(st.just(b""), st.binary(min_size=16, max_size=16), st.binary(max_size=40))


def framed_chunk(index: int, offset: int, data: bytes) -> bytes:
    return wire.page_chunk_header(index, offset, len(data)) + data


# ---- round trips --------------------------------------------------------------------


@given(index=uint32, offset=uint64, data=blobs)
def test_hand_framed_page_chunk_reads_as_protobuf(index, offset, data):
    message = pb.PageChunk.FromString(framed_chunk(index, offset, data))
    assert (message.index, message.offset, message.data) == (index, offset, data)


@given(index=uint32, offset=uint64, data=blobs)
def test_protobuf_page_chunk_reads_by_hand(index, offset, data):
    buf = pb.PageChunk(index=index, offset=offset, data=data).SerializeToString()
    got_index, got_offset, got_data, got_sums = wire.parse_page_chunk(buf)
    assert (got_index, got_offset, bytes(got_data), bytes(got_sums)) == (index, offset, data, b"")
    assert isinstance(got_data, memoryview)  # no copy of the page


@given(index=st.integers(1, 2**32 - 1), offset=st.integers(1, 2**64 - 1), data=st.binary(min_size=1, max_size=400))
def test_page_chunk_framing_is_byte_identical_when_no_field_is_default(index, offset, data):
    assert framed_chunk(index, offset, data) == pb.PageChunk(index=index, offset=offset, data=data).SerializeToString()


@given(key=keys, parent=keys, data=blobs, last=st.booleans())
def test_hand_framed_put_item_reads_as_protobuf(key, parent, data, last):
    message = pb.PutItem.FromString(wire.put_item(key, parent, data, last))
    assert (message.key, message.parent, message.data, message.last) == (key, parent, data, last)


@given(key=keys, parent=keys, data=blobs, last=st.booleans())
def test_protobuf_put_item_reads_by_hand(key, parent, data, last):
    buf = pb.PutItem(key=key, parent=parent, data=data, last=last).SerializeToString()
    got_key, got_parent, got_data, got_last, got_checksum = wire.parse_put_item(buf)
    assert (got_key, got_parent, bytes(got_data), got_last, got_checksum) == (key, parent, data, last, b"")


@given(index=uint32, offset=uint64, data=blobs, sums=st.binary(max_size=64))
def test_a_page_chunk_carries_its_checksums_both_ways(index, offset, data, sums):
    buf = wire.page_chunk_header(index, offset, len(data), sums) + data
    message = pb.PageChunk.FromString(buf)
    assert (message.index, message.offset, message.data, message.checksums) == (index, offset, data, sums)
    by_hand = pb.PageChunk(index=index, offset=offset, data=data, checksums=sums).SerializeToString()
    assert bytes(wire.parse_page_chunk(by_hand)[3]) == sums


@given(key=keys, parent=keys, data=blobs, last=st.booleans(), checksum=st.binary(max_size=16))
def test_a_put_item_carries_its_checksum_both_ways(key, parent, data, last, checksum):
    message = pb.PutItem.FromString(wire.put_item(key, parent, data, last, checksum))
    assert (message.key, message.data, message.last, message.checksum) == (key, data, last, checksum)
    by_hand = pb.PutItem(key=key, parent=parent, data=data, last=last, checksum=checksum).SerializeToString()
    assert wire.parse_put_item(by_hand)[4] == checksum


@given(key=keys, parent=keys, data=st.binary(min_size=1, max_size=400), last=st.booleans())
def test_put_item_framing_is_byte_identical_when_data_is_present(key, parent, data, last):
    expected = pb.PutItem(key=key, parent=parent, data=data, last=last).SerializeToString()
    assert wire.put_item(key, parent, data, last) == expected


@pytest.mark.parametrize("size", [0, 127, 128, 16383, 16384, 2_000_000])
def test_large_pages_frame_both_ways(size):
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    key, parent = b"k" * 16, b"p" * 16
    assert pb.PutItem.FromString(wire.put_item(key, parent, data)).data == data
    assert pb.PageChunk.FromString(framed_chunk(3, 5, data)).data == data
    assert bytes(wire.parse_put_item(pb.PutItem(key=key, data=data).SerializeToString())[2]) == data


def test_put_item_frames_any_buffer_without_changing_it():
    import numpy as np

    rows = np.arange(64, dtype=np.float32).reshape(4, 16)
    message = pb.PutItem.FromString(wire.put_item(b"k" * 16, b"", rows[1]))
    assert message.data == rows[1].tobytes()


def test_unknown_fields_are_skipped_like_protobuf_does():
    unknown = (
        bytes([(9 << 3) | 0, 0x96, 0x01])  # varint
        + bytes([(10 << 3) | 1]) + bytes(8)  # fixed64
        + bytes([(11 << 3) | 5]) + bytes(4)  # fixed32
        + bytes([(12 << 3) | 2, 2]) + b"zz"  # length-delimited
    )
    buf = wire.put_item(b"k" * 16, b"p" * 16, b"data") + unknown
    assert wire.parse_put_item(buf)[:2] == (b"k" * 16, b"p" * 16)
    assert pb.PutItem.FromString(buf).data == b"data"
    chunk = framed_chunk(7, 9, b"xyz") + unknown
    index, offset, data, _ = wire.parse_page_chunk(chunk)
    assert (index, offset, bytes(data)) == (7, 9, b"xyz")


# ---- malformed buffers --------------------------------------------------------------

MALFORMED = {
    "truncated varint": b"\x08\x80",
    "truncated tag": b"\x80",
    "overlong varint": b"\x08" + b"\xff" * 11 + b"\x01",
    "length beyond the end": b"\x1a\x05ab",
    "huge length": b"\x1a\xff\xff\xff\xff\x0f",
    "field number 0": b"\x00\x01",
    "start group": bytes([(5 << 3) | 3]),
    "end group": bytes([(5 << 3) | 4]),
    "wire type 6": bytes([(5 << 3) | 6]),
    "wire type 7": bytes([(5 << 3) | 7]),
    "truncated fixed64": bytes([(5 << 3) | 1]) + b"\x01\x02",
    "truncated fixed32": bytes([(5 << 3) | 5]) + b"\x01",
}


@pytest.mark.parametrize("buf", MALFORMED.values(), ids=MALFORMED.keys())
@pytest.mark.parametrize("parse", [wire.parse_page_chunk, wire.parse_put_item], ids=["PageChunk", "PutItem"])
def test_malformed_buffers_raise_malformed_message(parse, buf):
    with pytest.raises(wire.MalformedMessage):
        parse(buf)


@pytest.mark.parametrize(
    "parse, buf",
    [
        (wire.parse_page_chunk, b"\x0a\x01x"),  # index as bytes
        (wire.parse_page_chunk, b"\x12\x01x"),  # offset as bytes
        (wire.parse_page_chunk, b"\x18\x01"),  # data as a varint
        (wire.parse_put_item, b"\x08\x01"),  # key as a varint
        (wire.parse_put_item, b"\x10\x01"),  # parent as a varint
        (wire.parse_put_item, b"\x18\x01"),  # data as a varint
    ],
)
def test_a_field_of_the_wrong_wire_type_is_malformed(parse, buf):
    with pytest.raises(wire.MalformedMessage, match="wrong wire type"):
        parse(buf)


def assert_parses_like_protobuf_or_raises_malformed_message(buf: bytes) -> None:
    for parse, message_cls in ((wire.parse_page_chunk, pb.PageChunk), (wire.parse_put_item, pb.PutItem)):
        try:
            ours = parse(buf)
        except wire.MalformedMessage:
            continue
        try:
            theirs = message_cls.FromString(buf)
        except Exception:
            continue  # protobuf is stricter here; refusing or accepting are both safe
        fields = [getattr(theirs, f.name) for f in message_cls.DESCRIPTOR.fields]
        assert [bytes(v) if isinstance(v, memoryview) else v for v in ours] == fields


@settings(max_examples=300)
@given(buf=st.binary(max_size=64))
def test_any_bytes_parse_like_protobuf_or_raise_malformed_message_only(buf):
    assert_parses_like_protobuf_or_raises_malformed_message(buf)


def _varint_bytes(value: int, pad: int) -> bytes:
    """value as a varint, padded with `pad` redundant continuation bytes (still valid protobuf)."""
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value or pad:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)
        if not value:
            pad -= 1


_field = st.tuples(
    st.integers(1, 4),  # field number (4 is unknown to both messages)
    st.sampled_from([0, 1, 2, 5]),
    st.integers(0, 2**70),  # varints beyond 64 bits are truncated by protobuf
    st.integers(0, 2),
    st.binary(max_size=20),
)


def _encode(fields) -> bytes:
    out = b""
    for number, wire_type, value, pad, blob in fields:
        out += _varint_bytes(number << 3 | wire_type, 0)
        if wire_type == 0:
            out += _varint_bytes(value, pad)[:10]  # protobuf reads at most ten bytes
        elif wire_type == 1:
            out += (value % 2**64).to_bytes(8, "little")
        elif wire_type == 5:
            out += (value % 2**32).to_bytes(4, "little")
        else:
            out += _varint_bytes(len(blob), pad) + blob
    return out


@settings(max_examples=300)
@given(fields=st.lists(_field, max_size=5))
def test_structured_messages_read_the_same_by_hand_and_by_protobuf(fields):
    """Fields in any order and wire type, repeated, padded varints: agree with protobuf or refuse."""
    assert_parses_like_protobuf_or_raises_malformed_message(_encode(fields))


@pytest.mark.parametrize(
    "buf",
    [
        b"\x08" + _varint_bytes(2**32 + 5, 0),  # a uint32 field carrying more than 32 bits
        b"\x08" + b"\xff" * 9 + b"\x01",
        b"\x10" + b"\xff" * 9 + b"\x7f",  # a ten-byte varint beyond 64 bits
        b"\x10\x85\x80\x80\x80\x80\x00",  # padded varint
    ],
)
def test_odd_varints_read_as_protobuf_reads_them(buf):
    message = pb.PageChunk.FromString(buf)
    index, offset, _, _ = wire.parse_page_chunk(buf)
    assert (index, offset) == (message.index, message.offset)


@given(key=keys, parent=keys, data=blobs, cut=st.integers(0, 500))
def test_every_truncation_of_a_put_item_parses_or_raises_malformed_message(key, parent, data, cut):
    buf = wire.put_item(key, parent, data)
    try:
        wire.parse_put_item(buf[: min(cut, len(buf))])
    except wire.MalformedMessage:
        pass


@pytest.mark.parametrize("value", [-1, -(2**70)])
def test_a_negative_varint_is_a_value_error_not_an_endless_loop(value):
    with pytest.raises(ValueError, match="unsigned"):
        wire._varint(value)
    with pytest.raises(ValueError, match="unsigned"):
        wire.page_chunk_header(value, 0, 1)


@pytest.mark.parametrize("value", [0, 1, 127, 128, 2**63, 2**64 - 1])
def test_varints_at_the_edges_read_back_as_protobuf_does(value):
    assert pb.PageChunk.FromString(wire.page_chunk_header(0, value, 0)).offset == value
