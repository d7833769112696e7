"""What a client sends in pieces has a bound: a PutPages item must carry data (so a stream of
empty items cannot grow without end), a page sent in many pieces holds one page's bytes, and a
message of many unknown fields keeps none of them (docs/architecture.md, invariants). Key-count bounds per
method are in test_node_bad_input.py."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, raw_channel
from kvnode.wire import grpc_frames as wire
from kvnode.service import SERVICE_NAME
from protos import kvcache_pb2 as pb
from store_helpers import key


def put_raw(address: str, messages) -> pb.PutReply:
    channel = raw_channel(address)
    try:
        return pb.PutReply.FromString(
            channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None)(iter(messages), timeout=10))
    finally:
        channel.close()


@pytest.mark.parametrize("where", ["first item", "continuation"])
def test_an_item_without_data_is_refused_and_stores_nothing(node, where):
    k = key(1)
    if where == "first item":
        messages = [wire.put_item(k, b"", b""), wire.put_item(b"", b"", bytes(NODE_PAGE_BYTES), last=True)]
    else:
        messages = [wire.put_item(k, b"", bytes(10))] + [wire.put_item(b"", b"", b"")] * 100
    with pytest.raises(grpc.RpcError) as raised:
        put_raw(node.address, messages)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"item of page {k.hex()} carries no data" in raised.value.details()
    assert node.store.num_used() == 0


def test_a_page_in_many_small_pieces_is_assembled_whole(node, client):
    data = np.random.default_rng(3).integers(0, 256, NODE_PAGE_BYTES, dtype=np.uint8).tobytes()
    pieces = [data[i : i + 7] for i in range(0, NODE_PAGE_BYTES, 7)]
    messages = [wire.put_item(key(1), b"", pieces[0])]
    messages += [wire.put_item(b"", b"", p, last=i == len(pieces) - 2) for i, p in enumerate(pieces[1:])]
    reply = put_raw(node.address, messages)
    assert list(reply.outcomes) == [pb.PutReply.STORED]
    assert client.get_pages([key(1)]).tobytes() == data
    node.store.check_invariants()


def test_unknown_fields_are_skipped_not_kept():
    unknown = b"".join(wire._tag(field, 0) + b"\x01" for field in range(6, 20_006))  # 1-5 are PutItem's
    message = wire.put_item(key(1), b"", b"abc", last=True) + unknown
    assert set(wire.parse_fields(message, frozenset((1, 2, 3, 4)))) == {1, 3, 4}
    assert wire.parse_put_item(message) == (key(1), b"", memoryview(b"abc"), True, b"")
