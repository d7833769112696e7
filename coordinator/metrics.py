"""A coordinator's Prometheus metrics: members by role and state and routing affinity, read
when scraped; requests by outcome, resumes and failed attempts, counted once per request or
attempt by the service and the relay when the daemon has `--metrics-port`."""

from __future__ import annotations

from grpc import StatusCode
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from base.observability import request_histogram
from coordinator.membership import NODE, WORKER, Membership
from coordinator.router import Router

OUTCOMES = ("ok", "cancelled", "resource_exhausted", "unavailable", "deadline_exceeded", "invalid_argument")


class CoordinatorMetrics:
    def __init__(self, membership: Membership, router: Router, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        r.register(_ClusterCollector(membership, router))
        self.requests = Counter("kvcache_coordinator_requests", "Generate calls ended, by outcome (ok, cancelled by "
                                "the client, or the status code the client got)", ["outcome"], registry=r)
        self.resumes = Counter("kvcache_coordinator_resumes", "Attempts that resumed a request on another worker "
                               "after tokens were sent", registry=r)
        self.failed_attempts = Counter("kvcache_coordinator_failed_attempts", "Attempts on a worker that ended with "
                                       "a status, by code", ["code"], registry=r)
        self.request_duration = request_histogram(r, "kvcache_coordinator_request_duration_seconds", "Coordinator")
        for outcome in OUTCOMES:  # every usual series present from the first scrape
            self.requests.labels(outcome)

    def request_done(self, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def attempt_failed(self, code: StatusCode) -> None:
        self.failed_attempts.labels(code.name.lower()).inc()


class _ClusterCollector(Collector):
    def __init__(self, membership: Membership, router: Router):
        self.membership, self.router = membership, router

    def collect(self):
        counts = {(role, state): 0 for role in (NODE, WORKER) for state in ("alive", "dead")}
        for member in self.membership.members():
            counts[(member.role, "alive" if member.alive else "dead")] += 1
        members = GaugeMetricFamily("kvcache_coordinator_members", "Members this coordinator knows, by role and "
                                    "state", labels=["role", "state"])
        for (role, state), count in counts.items():
            members.add_metric([role, state], count)
        yield members
        affinity = CounterMetricFamily("kvcache_coordinator_route_affinity", "Worker choices, by whether they went "
                                       "to the worker that last served the placement key", labels=["hit"])
        affinity.add_metric(["true"], self.router.affinity[True])
        affinity.add_metric(["false"], self.router.affinity[False])
        yield affinity
