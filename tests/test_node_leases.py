"""Lease bounds through a real `kvcache node` over gRPC: a lookup asking to lease too many pages is
refused RESOURCE_EXHAUSTED naming the bound, and a client that leases all it may leaves the
node serving others."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster_helpers import NODE_PAGE_BYTES, node_process, raw_channel, run_kvcache
from kvnode.client import NodeClient, NodeError
from kvnode.service import LEASE_LIMITED_KEY, SERVICE_NAME
from protos import kvcache_pb2 as pb
from store_helpers import key

CAPACITY_PAGES = 16  # 16KiB of 1 KiB pages; half may be leased
ARGS = ("--capacity", "16KiB", "--page-bytes", str(NODE_PAGE_BYTES), "--max-leases-per-call", "4")


def put_chain(client: NodeClient, first: int, n: int) -> list[bytes]:
    keys = [key(first + i) for i in range(n)]
    data = np.full((n, NODE_PAGE_BYTES), first % 251, dtype=np.uint8)
    assert client.put_pages(keys, [b""] + keys[:-1], data).stored == n
    return keys


def lookup_with_trailer(address: str, keys: list[bytes], lease_ms: int) -> tuple[int, dict]:
    channel = raw_channel(address)
    try:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Lookup", pb.LookupRequest.SerializeToString,
                                   pb.LookupReply.FromString)
        reply, state = call.with_call(pb.LookupRequest(keys=keys, lease_ms=lease_ms), timeout=5)
        return reply.hits, dict(state.trailing_metadata() or ())
    finally:
        channel.close()


def test_lease_bounds_hold_through_a_real_node(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client:
        greedy = put_chain(client, 100, 10)
        with pytest.raises(NodeError) as raised:
            client.lookup(greedy[:5], lease_ms=60_000)
        assert raised.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "asked to lease up to 5 pages; this node leases at most 4 per call" in raised.value.details
        assert client.info().leased_pages == 0

        for start in (0, 4):
            assert client.lookup(greedy[start:start + 4], lease_ms=60_000) == 4
        hits, trailer = lookup_with_trailer(daemon.address, greedy[8:], lease_ms=60_000)
        assert hits == 0 and "leases at most 8 pages at once" in trailer[LEASE_LIMITED_KEY]
        assert client.info().leased_pages == CAPACITY_PAGES // 2
        assert client.lookup(greedy) == 10  # a probe without leases still sees every page

        # Another client's pages still find room: eviction takes the unleased half, over and over.
        for n in range(4):
            other = put_chain(client, 1000 + 10 * n, 8)
            assert client.lookup(other[:4], lease_ms=1000) == 0  # no lease left, so no hit it cannot count on
            assert client.lookup(other) == 8
        assert client.lookup(greedy[:8]) == 8  # the leased pages survived it all
    assert "lookup cut short" in (tmp_path / "node.log").read_text()


@pytest.mark.parametrize("args, message", [
    (["--max-leased-fraction", "1.5"], "--max-leased-fraction must be between 0 and 1, got 1.5"),
    (["--max-leases-per-call", "0"], "--max-leases-per-call must be at least 1, got 0"),
])
def test_lease_bound_options_out_of_range_are_one_clear_error_line(args, message):
    result = run_kvcache(["node", "--port", "0", "--capacity", "16KiB", "--page-bytes", "1024", *args])
    assert result.returncode == 2
    assert result.stderr.strip() == f"kvcache node: error: {message}"


def test_help_names_the_lease_bounds():
    result = run_kvcache(["node", "--help"])
    assert "--max-leased-fraction" in result.stdout and "--max-leases-per-call" in result.stdout
