"""A kvnode's Prometheus metrics. What the store counts already (pool, hits, evictions) is read
from it when scraped; what only the wires know (bytes per wire, put outcomes, data plane
durations) is counted once per request by the service and the data plane, through `NodeMetrics`
when the daemon has one (`--metrics-port`), never per page."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from base.observability import DURATION_BUCKETS
from kvnode.store.page_store import PageStore, PutOutcome

GRPC, DATA_PLANE = "grpc", "data_plane"
OUTCOMES = {PutOutcome.STORED: "stored", PutOutcome.ALREADY_PRESENT: "already_present",
            PutOutcome.REFUSED_NO_PARENT: "refused_no_parent", PutOutcome.REFUSED_NO_ROOM: "refused_no_room"}


class NodeMetrics:
    def __init__(self, store: PageStore, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.registry.register(_StoreCollector(store))
        self.puts = Counter("kvcache_node_put_pages", "Pages offered in puts, by outcome", ["outcome"],
                            registry=self.registry)
        self.sent = Counter("kvcache_node_sent_bytes", "Page bytes sent to clients, by wire", ["wire"],
                            registry=self.registry)
        self.received = Counter("kvcache_node_received_bytes", "Page bytes received in puts, by wire", ["wire"],
                                registry=self.registry)
        self.durations = Histogram("kvcache_node_request_duration_seconds",
                                   "Seconds a request took, by method (gRPC methods; DataGet, DataPut and "
                                   "DataLookup on the data plane)", ["method"], registry=self.registry, buckets=DURATION_BUCKETS)
        for outcome in OUTCOMES.values():
            self.puts.labels(outcome)
        for wire in (GRPC, DATA_PLANE):  # every series present from the first scrape
            self.sent.labels(wire), self.received.labels(wire)
        self._data_get = self.durations.labels("DataGet")
        self._data_put = self.durations.labels("DataPut")
        self._data_lookup = self.durations.labels("DataLookup")

    def pages_sent(self, wire: str, nbytes: int) -> None:
        self.sent.labels(wire).inc(nbytes)

    def pages_put(self, wire: str, nbytes: int, outcomes: Iterable[PutOutcome]) -> None:
        self.received.labels(wire).inc(nbytes)
        counts: dict[PutOutcome, int] = {}
        for outcome in outcomes:
            counts[outcome] = counts.get(outcome, 0) + 1
        for outcome, count in counts.items():
            self.puts.labels(OUTCOMES[outcome]).inc(count)

    def data_get(self, nbytes: int, seconds: float) -> None:
        self.pages_sent(DATA_PLANE, nbytes)
        self._data_get.observe(seconds)

    def data_put(self, nbytes: int, outcomes: Iterable[PutOutcome], seconds: float) -> None:
        self.pages_put(DATA_PLANE, nbytes, outcomes)
        self._data_put.observe(seconds)

    def data_lookup(self, seconds: float) -> None:
        self._data_lookup.observe(seconds)


class _StoreCollector(Collector):
    """The store's own numbers, read at scrape time (no cost between scrapes)."""

    def __init__(self, store: PageStore):
        self.store = store

    def collect(self):
        store, stats = self.store, self.store.stats
        yield GaugeMetricFamily("kvcache_node_pages_capacity", "Pages the pool holds", value=store.capacity_pages)
        yield GaugeMetricFamily("kvcache_node_pages_used", "Pages cached now", value=store.num_used())
        yield GaugeMetricFamily("kvcache_node_pages_leased", "Pages leased now (kept for a fetch)",
                                value=store.num_leased())
        yield GaugeMetricFamily("kvcache_node_page_bytes", "Bytes of one page", value=store.page_bytes)
        lookups = CounterMetricFamily("kvcache_node_lookup_pages", "Pages asked in lookups, by result", labels=["result"])
        lookups.add_metric(["hit"], stats.hit_pages)
        lookups.add_metric(["miss"], stats.miss_pages)
        yield lookups
        yield CounterMetricFamily("kvcache_node_lookups", "Lookup requests", value=stats.lookups)
        yield CounterMetricFamily("kvcache_node_lookups_lease_limited",
                                  "Lookups whose hits the leased-pages bound cut short", value=stats.lease_limited)
        yield CounterMetricFamily("kvcache_node_evicted_pages", "Pages evicted to make room", value=stats.evictions)
        yield CounterMetricFamily("kvcache_node_read_pages", "Pages read by clients (either wire)",
                                  value=stats.get_pages)
        yield CounterMetricFamily("kvcache_node_reported_dropped_pages", "Pages dropped because a reader found their "
                                  "bytes did not match their checksum, with their descendants", value=stats.reported_dropped)
        yield CounterMetricFamily("kvcache_node_reported_kept_pages", "Pages a reader reported altered that were "
                                  "intact here (kept: the bytes changed on the way or at the reader)",
                                  value=stats.reported_kept)
        if store.disk is not None:
            yield from _disk_tier(store, stats)


def _disk_tier(store: PageStore, stats):
    """The disk tier's numbers (kvcache node --data-dir): pages per tier, I/O, what recovery found."""
    pages = GaugeMetricFamily("kvcache_node_tier_pages", "Pages held, by tier (a page in RAM is also on disk once "
                              "flushed)", labels=["tier"])
    pages.add_metric(["ram"], store.num_in_ram())
    pages.add_metric(["disk"], store.num_on_disk())
    yield pages
    capacity = GaugeMetricFamily("kvcache_node_tier_pages_capacity", "Pages each tier can hold", labels=["tier"])
    capacity.add_metric(["ram"], store.ram_capacity_pages)
    capacity.add_metric(["disk"], store.capacity_pages)
    yield capacity
    yield GaugeMetricFamily("kvcache_node_dirty_pages", "Pages in RAM not yet written to disk", value=store.num_dirty())
    for name, what, value in (
            ("disk_read_pages", "Pages read from the disk tier (promotions and pages served from disk)", stats.disk_reads),
            ("disk_written_pages", "Pages written to the disk tier (flushes, demotions, write-through)", stats.disk_writes),
            ("promoted_pages", "Pages read from disk into RAM", stats.promotions),
            ("demoted_pages", "RAM copies dropped to make room (the page stays on disk)", stats.demotions),
            ("corrupted_dropped_pages", "Pages whose bytes on disk failed their checksum, at start or on a read",
             stats.corrupted_dropped),
            ("orphan_dropped_pages", "Intact pages dropped because an ancestor was corrupted or lost",
             stats.orphans_dropped),
            ("disk_errors", "Reads, writes and syncs of the disk tier that failed", stats.disk_errors)):
        yield CounterMetricFamily(f"kvcache_node_{name}", what, value=value)
    yield GaugeMetricFamily("kvcache_node_recovered_pages", "Pages found intact on disk at start",
                            value=stats.recovered_pages)
    yield GaugeMetricFamily("kvcache_node_recovery_seconds", "Seconds the start took to recover the disk tier's pages",
                            value=stats.recovery_seconds)
