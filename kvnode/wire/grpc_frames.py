"""Hand framing of the two bulk messages, PageChunk and PutItem.

They carry whole pages; protobuf in Python copies a `bytes` field on every read and
serializing a message copies it again. Framing them by hand keeps one copy per side
and stays byte-compatible with kvcache.v1 (any protobuf client reads and writes them).
"""

from __future__ import annotations

_VARINT, _LEN = 0, 2


def _varint(value: int) -> bytes:
    if value < 0:  # shifting a negative int right never reaches 0: it would loop forever
        raise ValueError(f"a varint here is unsigned; got {value}")
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


_CHUNK_INDEX, _CHUNK_OFFSET, _CHUNK_DATA = _tag(1, _VARINT), _tag(2, _VARINT), _tag(3, _LEN)
_CHUNK_CHECKSUMS = _tag(4, _LEN)
_ITEM_KEY, _ITEM_PARENT, _ITEM_DATA = _tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN)
_ITEM_LAST = _tag(4, _VARINT) + _varint(1)
_ITEM_CHECKSUM = _tag(5, _LEN)


def page_chunk_header(index: int, offset: int, length: int, checksums: bytes = b"") -> bytes:
    """Everything of a PageChunk before its data: append `length` bytes of data to complete it.
    `checksums`: those of the pages that start in it (fields may come in any order)."""
    parts = [_CHUNK_INDEX, _varint(index), _CHUNK_OFFSET, _varint(offset)]
    if checksums:
        parts += [_CHUNK_CHECKSUMS, _varint(len(checksums)), checksums]
    return b"".join((*parts, _CHUNK_DATA, _varint(length)))


def put_item(key: bytes, parent: bytes, data, last: bool = False, checksum: bytes = b"") -> bytes:
    """A whole PutItem message (one copy of `data`); `last` marks the stream's final item."""
    parts = []
    if key:
        parts += [_ITEM_KEY, _varint(len(key)), key]
    if parent:
        parts += [_ITEM_PARENT, _varint(len(parent)), parent]
    if checksum:
        parts += [_ITEM_CHECKSUM, _varint(len(checksum)), checksum]
    view = memoryview(data).cast("B")
    parts += [_ITEM_DATA, _varint(view.nbytes), view]
    if last:
        parts.append(_ITEM_LAST)
    return b"".join(parts)


_UINT64, _UINT32 = 2**64 - 1, 2**32 - 1


class MalformedMessage(ValueError):
    pass


def parse_fields(buf: bytes, wanted: frozenset[int] | None = None) -> dict[int, object]:
    """Fields of a protobuf message: int for varints, memoryview (no copy) for length-delimited.

    A repeated field keeps its last value, as protobuf does for singular fields. With `wanted`,
    other fields are skipped, not kept: a message of many unknown fields costs no memory.
    """
    view = memoryview(buf)
    fields: dict[int, object] = {}
    pos, end = 0, len(view)

    def read_varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise MalformedMessage("truncated or overlong varint")
            byte = view[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result & _UINT64  # protobuf keeps the low 64 bits of a longer varint
            shift += 7

    while pos < end:
        tag = read_varint()
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise MalformedMessage("field number 0")
        keep = wanted is None or field in wanted
        if wire_type == _VARINT:
            value = read_varint()
            if keep:
                fields[field] = value
        elif wire_type == _LEN:
            length = read_varint()
            if pos + length > end:
                raise MalformedMessage(f"field {field} claims {length} bytes, {end - pos} remain")
            if keep:
                fields[field] = view[pos : pos + length]
            pos += length
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        else:
            raise MalformedMessage(f"unsupported wire type {wire_type}")
        if pos > end:
            raise MalformedMessage("truncated fixed-width field")
    return fields


_CHUNK_FIELDS, _ITEM_FIELDS = frozenset((1, 2, 3, 4)), frozenset((1, 2, 3, 4, 5))


def parse_page_chunk(buf: bytes) -> tuple[int, int, memoryview, memoryview]:
    """(index, offset, data, checksums) of a PageChunk."""
    fields = parse_fields(buf, _CHUNK_FIELDS)
    index, offset, data = fields.get(1, 0), fields.get(2, 0), fields.get(3, memoryview(b""))
    checksums = fields.get(4, memoryview(b""))
    if not isinstance(index, int) or not isinstance(offset, int) or not isinstance(data, memoryview) \
            or not isinstance(checksums, memoryview):
        raise MalformedMessage("PageChunk field has the wrong wire type")
    return index & _UINT32, offset, data, checksums  # index is a uint32: protobuf keeps its low 32 bits


def parse_put_item(buf: bytes) -> tuple[bytes, bytes, memoryview, bool, bytes]:
    """(key, parent, data, last, checksum) of a PutItem; checksum b"" when it carries none."""
    fields = parse_fields(buf, _ITEM_FIELDS)
    key, parent, data, checksum = (fields.get(n, memoryview(b"")) for n in (1, 2, 3, 5))
    last = fields.get(4, 0)
    if not all(isinstance(f, memoryview) for f in (key, parent, data, checksum)) or not isinstance(last, int):
        raise MalformedMessage("PutItem field has the wrong wire type")
    return bytes(key), bytes(parent), data, bool(last), bytes(checksum)
