"""`kvcache node --metrics-port 0` as a real process: its /metrics, scraped over loopback and
parsed by prometheus_client, moves by exactly what a client did (pages put and their outcomes,
hits and misses, bytes per wire); the port is off without the option, and bad HTTP input
leaves the node serving."""

from __future__ import annotations

import socket

import numpy as np

from cluster_helpers import NODE_PAGE_BYTES, node_process, read_log, wait_for
from kvnode.client import NodeClient
from metrics_helpers import delta, scrape
from store_helpers import key

ARGS = ("--capacity", "8KiB", "--page-bytes", str(NODE_PAGE_BYTES), "--metrics-port", "0")


def pages(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(count, NODE_PAGE_BYTES), dtype=np.uint8)


def test_node_counters_move_by_exactly_what_the_client_did(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        url = daemon.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        with NodeClient(daemon.address) as fast, NodeClient(daemon.address, use_data_plane=False) as slow:
            before = scrape(url)
            assert before.value("kvcache_node_pages_capacity") == 8
            assert before.value("kvcache_node_pages_used") == 0
            chain = [key(i) for i in range(1, 5)]
            parents = [b"", *chain[:-1]]
            # Data plane: 3 pages stored; then gRPC: the same 3 again (already present) and a 4th.
            assert fast.put_pages(chain[:3], parents[:3], pages(3)).stored == 3
            result = slow.put_pages(chain, parents, pages(4))
            assert (result.stored, result.already_present) == (1, 3)
            assert slow.put_pages([key(99)], [key(98)], pages(1)).refused == 1  # its parent is not cached
            assert fast.lookup(chain + [key(5), key(6)], lease_ms=1000) == 4  # 4 hits, 2 misses, 4 leased
            assert slow.lookup([key(5)]) == 0  # 1 miss, over gRPC
            fast.get_pages(chain[:2])
            slow.get_pages(chain[:3])
            after = scrape(url)
        page = NODE_PAGE_BYTES
        assert delta(after, before, "kvcache_node_put_pages_total", outcome="stored") == 4
        assert delta(after, before, "kvcache_node_put_pages_total", outcome="already_present") == 3
        assert delta(after, before, "kvcache_node_put_pages_total", outcome="refused_no_parent") == 1
        assert delta(after, before, "kvcache_node_put_pages_total", outcome="refused_no_room") == 0
        assert delta(after, before, "kvcache_node_received_bytes_total", wire="data_plane") == 3 * page
        assert delta(after, before, "kvcache_node_received_bytes_total", wire="grpc") == 5 * page
        assert delta(after, before, "kvcache_node_sent_bytes_total", wire="data_plane") == 2 * page
        assert delta(after, before, "kvcache_node_sent_bytes_total", wire="grpc") == 3 * page
        assert delta(after, before, "kvcache_node_lookup_pages_total", result="hit") == 4
        assert delta(after, before, "kvcache_node_lookup_pages_total", result="miss") == 3
        assert after.value("kvcache_node_pages_used") == 4
        assert after.value("kvcache_node_pages_leased") == 4
        assert delta(after, before, "kvcache_node_evicted_pages_total") == 0
        # One duration per request, by method, gRPC and data plane alike.
        count = "kvcache_node_request_duration_seconds_count"
        assert delta(after, before, count, method="PutPages") == 2
        assert delta(after, before, count, method="DataPut") == 1
        assert delta(after, before, count, method="DataGet") == 1
        assert delta(after, before, count, method="GetPages") == 1
        assert delta(after, before, count, method="Lookup") == 1
        assert delta(after, before, count, method="DataLookup") == 1
        assert after.value("kvcache_node_request_duration_seconds_bucket", method="Lookup", le="60.0") >= 1
    log = read_log(tmp_path)
    assert log.count(f"metrics on {url}") == 1


def test_evictions_are_counted(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon, NodeClient(daemon.address) as client:
        before = scrape(daemon.metrics_url)
        roots = [key(100 + i) for i in range(10)]  # 10 root pages into 8 slots: 2 evicted
        assert client.put_pages(roots, [b""] * 10, pages(10)).stored == 10
        after = scrape(daemon.metrics_url)
    assert delta(after, before, "kvcache_node_evicted_pages_total") == 2
    assert after.value("kvcache_node_pages_used") == 8


def test_no_metrics_port_without_the_option(tmp_path):
    with node_process(tmp_path, "--capacity", "8KiB", "--page-bytes", str(NODE_PAGE_BYTES)) as daemon:
        assert daemon.metrics_url is None
    assert "metrics on" not in read_log(tmp_path)


def test_bad_http_input_leaves_the_node_serving(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        host, port = daemon.metrics_url[len("http://"):].split("/")[0].rsplit(":", 1)
        for garbage in (b"\x00\xff" * 1000 + b"\r\n\r\n", b"GET /" + b"a" * 100_000 + b" HTTP/1.1\r\n\r\n",
                        b"POST /metrics HTTP/1.1\r\nContent-Length: 99999999\r\n\r\nxx", b""):
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                conn.sendall(garbage)
                conn.shutdown(socket.SHUT_WR)
                conn.settimeout(5)
                try:
                    while conn.recv(65536):
                        pass
                except OSError:
                    pass
        assert daemon.alive()
        assert scrape(daemon.metrics_url).value("kvcache_node_pages_capacity") == 8
        with NodeClient(daemon.address) as client:
            assert client.info().capacity_pages == 8


def test_the_disk_tier_is_counted_per_tier_and_at_restart(tmp_path):
    data = tmp_path / "data"
    args = ("--capacity", "8KiB", "--page-bytes", str(NODE_PAGE_BYTES), "--data-dir", str(data),
            "--disk-capacity", "64KiB", "--flush-interval", "0.1", "--metrics-port", "0")
    chain = [key(i) for i in range(1, 21)]   # 20 pages: 8 fit in RAM, every one on disk
    with node_process(tmp_path, *args) as daemon, NodeClient(daemon.address) as client:
        before = scrape(daemon.metrics_url)
        assert client.put_pages(chain, [b"", *chain[:-1]], pages(20)).stored == 20
        assert wait_for(lambda: client.info().dirty_pages == 0, timeout_s=20), "not flushed in time"
        disk_capacity = client.info().disk_capacity_pages
        flushed = scrape(daemon.metrics_url)
        client.get_pages(chain[:4])          # on disk only now: read from there and promoted
        after = scrape(daemon.metrics_url)
    assert flushed.value("kvcache_node_tier_pages", tier="ram") == 8
    assert flushed.value("kvcache_node_tier_pages", tier="disk") == 20
    assert flushed.value("kvcache_node_tier_pages_capacity", tier="ram") == 8
    assert flushed.value("kvcache_node_tier_pages_capacity", tier="disk") == disk_capacity > 20
    assert flushed.value("kvcache_node_dirty_pages") == 0
    assert delta(flushed, before, "kvcache_node_disk_written_pages_total") == 20
    assert delta(flushed, before, "kvcache_node_demoted_pages_total") == 12
    assert delta(after, flushed, "kvcache_node_disk_read_pages_total") == 4
    assert delta(after, flushed, "kvcache_node_promoted_pages_total") == 4
    assert after.value("kvcache_node_disk_errors_total") == 0
    with node_process(tmp_path, *args) as daemon:
        restarted = scrape(daemon.metrics_url)
    assert restarted.value("kvcache_node_recovered_pages") == 20
    assert restarted.value("kvcache_node_recovery_seconds") > 0
    assert restarted.value("kvcache_node_corrupted_dropped_pages_total") == 0
    assert restarted.value("kvcache_node_orphan_dropped_pages_total") == 0


def test_a_node_without_a_disk_tier_has_no_disk_metrics(tmp_path):
    with node_process(tmp_path, *ARGS) as daemon:
        names = scrape(daemon.metrics_url).names()
    assert "kvcache_node_pages_used" in names and "kvcache_node_reported_kept_pages_total" in names
    assert not [n for n in names if "disk" in n or "tier" in n]
