"""LOOKUP, the data plane's lookup (kvnode/wire/data_frames.py: lookup_request): NodeClient.lookup goes over the
data plane when the client uses one and answers what gRPC's Lookup answers, hits and leases alike;
its refusals carry gRPC's codes (a RESOURCE_EXHAUSTED, a refused lease or a node at its connection
bound, is asked over gRPC, which refuses the one and serves the other); a refused LOOKUP is read
away so its answer arrives and the node goes on serving; a node that predates the op is asked over
gRPC from then on, and still serves the pages over the data plane."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_CAPACITY_PAGES, wait_for
from data_plane_helpers import (GOOD, INVALID, MAX_KEYS, assert_unharmed, closed_by_node, pages, raw_connection,
                                read_reply)
from kvnode.wire import data_frames as dw
from kvnode.client import NodeError
from kvnode.store.types import LeaseRefused
from store_helpers import key

pytestmark = pytest.mark.usefixtures("no_kvnode_errors_logged")

MISSING = [key(50), key(51)]


def grpc_lookup_forbidden(client) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("this lookup was to go over the data plane, not gRPC")

    client._lookup = forbidden


def counted_grpc_lookups(client) -> list[int]:
    """The count of keys of each gRPC Lookup `client` makes, appended as it is made."""
    asked, stub = [], client._lookup

    def counted(request, **kwargs):
        asked.append(len(request.keys))
        return stub(request, **kwargs)

    client._lookup = counted
    return asked


def counted_lookups(plane, monkeypatch) -> list[int]:
    """The count of each LOOKUP the data plane served, appended as it is served."""
    served = []
    serve = plane._lookup

    def counting(connection, header):
        served.append(header.count)
        return serve(connection, header)

    monkeypatch.setattr(plane, "_lookup", counting)
    return served


@pytest.mark.parametrize("keys, hits", [
    (GOOD, 3),                      # fully cached
    (GOOD[:2], 2),
    (GOOD + MISSING, 3),            # partly cached
    ([GOOD[0], MISSING[0], GOOD[2]], 1),
    (MISSING, 0),                   # not cached
    ([MISSING[0]] + GOOD, 0),       # counted from the first key
])
def test_a_lookup_over_the_data_plane_answers_what_grpc_answers(seeded, plane, monkeypatch, keys, hits):
    served = counted_lookups(plane, monkeypatch)
    with seeded.client() as fast, seeded.client(use_data_plane=False) as slow:
        grpc_lookup_forbidden(fast)
        assert fast.lookup(keys) == slow.lookup(keys) == hits
        assert fast.lookup(keys, lease_ms=1000, timeout=2) == hits
    assert served == [len(keys), len(keys)]
    assert seeded.store.num_leased() == hits


def test_a_first_lookup_asks_info_once_within_its_own_timeout(seeded, plane):
    with seeded.client(timeout=30.0) as fast:
        grpc_lookup_forbidden(fast)
        asked, info = [], fast._info

        def timed(request, timeout=None):
            asked.append(timeout)
            return info(request, timeout=timeout)

        fast._info = timed
        assert fast.lookup(GOOD, timeout=2.0) == 3
        assert fast.lookup(GOOD, timeout=2.0) == 3
    assert asked == [2.0], "Info is asked once, first, within the lookup's timeout, not the client's"


def test_pages_leased_over_the_data_plane_are_not_evicted(seeded, plane):
    with seeded.client() as fast, seeded.client(use_data_plane=False) as slow:
        grpc_lookup_forbidden(fast)
        lookups = seeded.store.stats.lookups
        assert fast.lookup(GOOD + MISSING, lease_ms=60_000) == 3
        assert seeded.store.stats.lookups == lookups + 1
        assert seeded.store.num_leased() == 3 and fast.info().leased_pages == 3
        others = [key(100 + i) for i in range(NODE_CAPACITY_PAGES)]  # as many roots as the pool holds
        slow.put_pages(others, [b""] * len(others), pages(len(others), 7))
        assert seeded.store.stats.evictions > 0
        assert set(GOOD) <= set(seeded.store.keys()), "eviction passed the leased pages by"
        assert fast.lookup(GOOD) == 3


def test_refusals_carry_the_codes_grpc_gives(seeded, plane):
    with seeded.client() as fast, seeded.client(use_data_plane=False) as slow:
        for keys, lease_ms, code in [
            ([GOOD[0]] * (MAX_KEYS + 1), 0, INVALID),  # too many keys
            ([b"short"], 0, INVALID),  # a key of the wrong size
            (GOOD, 60_001, INVALID),  # a lease over 60 s
        ]:
            codes = []
            for client in (fast, slow):
                with pytest.raises(NodeError) as raised:
                    client.lookup(keys, lease_ms=lease_ms)
                codes.append(raised.value.code)
            assert codes == [code, code], (keys, lease_ms)
        assert fast.lookup([]) == slow.lookup([]) == 0  # no keys: asked over gRPC, as ever

        seeded.store.max_leases_per_call = 2  # --max-leases-per-call 2
        over_grpc = counted_grpc_lookups(fast)
        for client in (fast, slow):
            with pytest.raises(NodeError) as raised:
                client.lookup(GOOD, lease_ms=1000)
            assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "asked to lease up to 3 pages; this node leases at most 2 per call" in raised.value.details
        assert over_grpc == [3], "refused over the data plane, then by gRPC's Lookup, whose answer the caller gets"
        grpc_lookup_forbidden(fast)
        assert fast.lookup(GOOD[:2], lease_ms=1000) == 2
        assert fast.use_data_plane and not fast._told_busy, "a refused lease is no sign of a busy data plane"
    assert seeded.store.num_leased() == 2


def test_a_refused_lease_is_told_by_its_code_not_its_message(seeded, plane, monkeypatch):
    def refuse(keys, lease_ms=0):
        raise LeaseRefused("no")  # none of the words the node says today

    monkeypatch.setattr(seeded.store, "lookup_and_lease", refuse)
    served = counted_lookups(plane, monkeypatch)
    with seeded.client() as fast:
        for _ in range(2):
            with pytest.raises(NodeError) as raised:
                fast.lookup(GOOD, lease_ms=1000)
            assert (raised.value.code, raised.value.details) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "no")
        assert served == [3, 3], "asked over the data plane each time"
        assert fast.use_data_plane and not fast._told_busy, "a refused lease is no sign of a busy data plane"


def test_a_lookup_to_a_data_plane_at_its_connection_bound_is_answered_over_grpc(seeded, plane):
    with contextlib.ExitStack() as stack:
        for _ in range(plane.max_connections):
            stack.enter_context(raw_connection(plane))
        assert wait_for(lambda: plane.num_connections() == plane.max_connections)
        with seeded.client() as fast:
            over_grpc = counted_grpc_lookups(fast)
            assert fast.lookup(GOOD + MISSING, lease_ms=1000) == 3
            assert over_grpc == [5] and fast.use_data_plane
    assert seeded.store.num_leased() == 3


@pytest.mark.parametrize("request_bytes, fragment", [
    (dw.request_header(dw.OP_LOOKUP, MAX_KEYS + 1) + GOOD[0] * (MAX_KEYS + 1) + dw.LEASE.pack(0),
     f"at most {MAX_KEYS}"),
    (dw.request_header(dw.OP_LOOKUP, 0) + dw.LEASE.pack(0), "at least one key"),
    (dw.lookup_request(GOOD, 60_001), "lease_ms must be between 0 and 60000"),
    (dw.lookup_request(GOOD, 2**64 - 1), "lease_ms must be between 0 and 60000"),
], ids=["too many keys", "no keys", "long lease", "huge lease"])
def test_a_refused_lookup_is_read_away_answered_and_the_node_serves_on(seeded, plane, request_bytes, fragment):
    header = dw.parse_request_header(request_bytes[: dw.REQUEST.size])
    assert dw.request_bytes(header) == len(request_bytes) - dw.REQUEST.size, "what a refusal reads away"
    for _ in range(3):
        with raw_connection(plane) as sock:
            sock.sendall(request_bytes)  # the whole request, lease included, before the answer is read
            code, message, payload = read_reply(sock)
            assert code == INVALID and fragment in message and payload == b""
            assert closed_by_node(sock)
    with raw_connection(plane) as sock:
        for lease_ms in (0, 1000):  # one connection, several lookups
            sock.sendall(dw.lookup_request(GOOD + MISSING, lease_ms))
            assert read_reply(sock) == (grpc.StatusCode.OK, "", dw.HITS.pack(3))
        sock.sendall(dw.get_request(GOOD[:1]))  # and a GET after them
        code, _, payload = read_reply(sock)
        assert code == grpc.StatusCode.OK and payload[16:] == pages(3)[0].tobytes()
    # the refused connections were closed by the node; its handlers let go of them a moment later
    assert wait_for(lambda: plane.num_connections() <= 1, timeout_s=5.0)
    assert seeded.store.num_leased() == 3
    assert_unharmed(seeded, plane, set(GOOD))


def test_a_lookup_cut_by_the_leased_pages_bound_answers_the_leased_hits_and_says_so(seeded, plane, caplog):
    seeded.store.max_leased_pages = seeded.store._leases.max_leased = 2  # what --max-leased-fraction sets
    with seeded.client() as fast:
        grpc_lookup_forbidden(fast)
        assert fast.lookup(GOOD, lease_ms=1000) == 2
    assert any("lookup cut short: 2 hits" in r.getMessage() for r in caplog.records)


def test_a_node_that_predates_the_op_is_asked_over_grpc_and_keeps_serving_pages(seeded, plane, monkeypatch, caplog):
    monkeypatch.setattr(dw, "OPS", {op: name for op, name in dw.OPS.items() if op != dw.OP_LOOKUP})
    with seeded.client() as client:
        grpc_calls = counted_grpc_lookups(client)
        for _ in range(3):
            assert client.lookup(GOOD + MISSING, lease_ms=1000) == 3
        assert grpc_calls == [5, 5, 5]

        def no_grpc_pages(*args, **kwargs):
            raise AssertionError("pages were to come over the data plane")

        client._get_pages = no_grpc_pages
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
        assert client.use_data_plane and client.data_plane_address() == f"127.0.0.1:{plane.port}"
    said = [r.getMessage() for r in caplog.records if "predates LOOKUP" in r.getMessage()]
    assert len(said) == 1
    assert seeded.store.num_leased() == 3


def test_without_the_data_plane_a_lookup_goes_over_grpc(seeded, plane, monkeypatch):
    served = counted_lookups(plane, monkeypatch)
    with seeded.client(use_data_plane=False) as client:
        assert client.lookup(GOOD, lease_ms=1000) == 3
    assert served == []
