"""Random PutPages streams, whole or with one flaw, against an in-process node: a whole
stream stores every page; a stream with any flaw is refused with INVALID_ARGUMENT and
changes nothing; the invariants hold either way."""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster_helpers import raw_channel, serve_node
from kvnode.wire import grpc_frames as wire
from kvnode.service import SERVICE_NAME
from kvnode.store.page_store import PageStore
from protos import kvcache_pb2 as pb
from store_helpers import key

PAGE = 64
FLAWS = [
    "key of 15 bytes", "parent of 17 bytes", "names itself as parent", "page one byte short",
    "page one byte long", "continuation with a parent", "continuation first", "no last mark",
    "item after the last", "last mark too early", "a message that does not parse",
]


@st.composite
def streams(draw):
    """(pages, flaw, flaw_at): each page a list of chunk sizes summing to PAGE."""
    num_pages = draw(st.integers(1, 4), label="pages")
    pages = []
    for _ in range(num_pages):
        cuts = sorted(draw(st.sets(st.integers(1, PAGE - 1), max_size=2), label="cuts"))
        bounds = [0, *cuts, PAGE]
        pages.append([b - a for a, b in zip(bounds, bounds[1:])])
    flaw = draw(st.one_of(st.none(), st.sampled_from(FLAWS)), label="flaw")
    return pages, flaw, draw(st.integers(0, num_pages - 1), label="flawed page")


def build(pages, flaw, flawed, keys, root):
    """The stream's messages, with `flaw` applied to page number `flawed`."""
    items = []  # [key, parent, data, last] per message
    for number, sizes in enumerate(pages):
        parent = root if number == 0 else keys[number - 1]
        if number == flawed and flaw == "page one byte short":
            sizes = sizes[:-1] + [sizes[-1] - 1] if sizes[-1] > 1 else sizes[:-1]
        if number == flawed and flaw == "page one byte long":
            sizes = sizes[:-1] + [sizes[-1] + 1]
        for part, size in enumerate(sizes):
            first = part == 0
            items.append([keys[number] if first else b"", parent if first else b"", bytes([number]) * size, False])
        first_of_page = len(items) - len(sizes)
        if number == flawed:
            if flaw == "key of 15 bytes":
                items[first_of_page][0] = keys[number][:15]
            elif flaw == "parent of 17 bytes":
                items[first_of_page][1] = parent + b"!"
            elif flaw == "names itself as parent":
                items[first_of_page][1] = keys[number]
            elif flaw == "continuation with a parent":
                items.append([b"", parent, b"", False])  # an empty continuation, but with a parent
            elif flaw == "continuation first" and number == 0:
                items.insert(0, [b"", b"", b"", False])
            elif flaw == "last mark too early":
                items[first_of_page][3] = True
                if number == len(pages) - 1 and len(sizes) == 1:
                    items.append([b"", b"", b"", False])  # something must follow the early mark
    if flaw != "no last mark":
        items[-1][3] = True
    messages = [wire.put_item(k, p, d, last) for k, p, d, last in items]
    if flaw == "item after the last":
        messages.append(wire.put_item(b"", b"", b""))
    if flaw == "continuation first" and flawed != 0:
        messages.insert(0, wire.put_item(b"", b"", b""))
    if flaw == "a message that does not parse":
        messages.insert(min(flawed + 1, len(messages)), b"\x0a\xff\x01")
    return messages


def test_random_put_streams_store_all_or_nothing():
    store = PageStore(4096, PAGE)
    root = key(-1)
    assert store.put(root, b"", bytes(PAGE)) == 1
    numbers = itertools.count()
    with serve_node(store, max_keys=8, max_message_bytes=4096) as node:
        channel = raw_channel(node.address)
        put = channel.stream_unary(f"/{SERVICE_NAME}/PutPages", None, None)

        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(case=streams())
        def check(case):
            pages, flaw, flawed = case
            keys = [key(next(numbers)) for _ in pages]
            messages = build(pages, flaw, flawed, keys, root)
            before, puts = set(store.keys()), store.stats.puts
            if flaw is None:
                reply = pb.PutReply.FromString(put(iter(messages), timeout=5))
                assert list(reply.outcomes) == [pb.PutReply.STORED] * len(pages)
                assert set(store.keys()) == before | set(keys)
            else:
                with pytest.raises(grpc.RpcError) as raised:
                    put(iter(messages), timeout=5)
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (flaw, raised.value.details())
                assert set(store.keys()) == before, flaw
                assert store.stats.puts == puts
            store.check_invariants()

        try:
            check()
        finally:
            channel.close()
