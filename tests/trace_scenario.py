"""Run by test_tracing.py in a child process (a tracer provider is set once per process, so the
test's own process stays without one): an in-process coordinator, two workers and two kvnodes, each
gRPC server with the daemons' interceptors, the SDK's in-memory exporter; prints the spans of
the calls below as JSON lines, and the trace context each server received with each call:
two client calls in a trace, one through the HTTP gateway (uvicorn on a thread) with the client's
`traceparent` header, one outside any, one in an unsampled trace, then housekeeping calls
(Register, Heartbeat, the node's Info and Stats) outside any trace."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import sys
import threading
import time

import grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

PROMPT = "You are the support assistant of a small bakery. Be kind, be brief, and never invent prices. " * 2


def main() -> int:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)

    # Imported after the provider is set, as a daemon sets it before it builds its parts.
    from coordinator import service as coordinator_service
    from coordinator.client import Client
    from coordinator.membership import Membership
    from kvnode import service as node_service
    from kvnode.client import NodeClient
    from protos import kvcache_pb2 as pb
    from kvnode.store.page_store import PageStore
    from base import observability, serving
    from worker import service as worker_service
    from worker.client import WorkerClient
    from worker.engine.engine import Engine
    from worker.observe import ObservedRemoteTier, attach

    received = []  # (method, traceparent or None) as each server saw them

    class Received(grpc.ServerInterceptor):
        def intercept_service(self, continuation, details):
            carried = dict(details.invocation_metadata or ()).get("traceparent")
            received.append({"received": details.method, "traceparent": carried})
            return continuation(details)

    def serve(stack, handler, name, roots=()):
        server, health = serving.make_server(
            [handler], [name], max_workers=8,
            interceptors=[Received()] + observability.server_interceptors(name, None, roots))
        port = serving.bind(server, "127.0.0.1", 0)
        server.start()
        stack.callback(serving.stop, server, health, 0.5)
        return f"127.0.0.1:{port}"

    def start_worker(stack):
        engine = Engine.load("tiny", kv_cache_bytes=16 * 2**20)
        tier = ObservedRemoteTier(engine.kv_pool, "float32", tracing=True)
        engine.attach_remote_tier(tier)
        service = worker_service.WorkerService(engine)
        attach(service, tier, None, tracing=True)
        service.start()
        stack.callback(tier.close)
        stack.callback(service.stop)
        address = serve(stack, worker_service.handler(service), worker_service.SERVICE_NAME, worker_service.TRACE_ROOTS)
        return address, engine, tier

    def serve_gateway(stack, coordinator_address) -> int:
        import uvicorn

        from coordinator.aio_client import AsyncClient
        from gateway.app import create_app
        from gateway.upstream import Upstream

        app = create_app(Upstream(lambda: AsyncClient([coordinator_address]), 4), 1 << 20, 10.0)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()

        def stop():
            server.should_exit = True
            thread.join(10.0)
            sock.close()

        stack.callback(stop)
        deadline = time.monotonic() + 30.0
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.02)
        return sock.getsockname()[1]

    tracer = trace.get_tracer("test-client")
    with contextlib.ExitStack() as stack:
        first, engine, first_tier = start_worker(stack)
        second, _, second_tier = start_worker(stack)
        page_bytes = engine.model.page_bytes("float32", engine.page_tokens)
        node, replica = (serve(stack, node_service.handler(node_service.KVStoreService(PageStore(256, page_bytes), n)),
                               node_service.SERVICE_NAME) for n in ("node-0", "node-1"))
        membership = Membership(dead_after_s=600.0)
        for address in (node, replica):
            membership.register("node", address, capacity_bytes=256 * page_bytes, page_bytes=page_bytes)
        membership.register("worker", first, page_bytes=page_bytes, model="tiny")
        coordinator = coordinator_service.CoordinatorService(membership, replicas=2)  # pages written to both
        stack.callback(coordinator.close)
        address = serve(stack, coordinator_service.handler(coordinator), coordinator_service.SERVICE_NAME,
                        coordinator_service.TRACE_ROOTS)

        with tracer.start_as_current_span("client.first"), Client([address]) as client:
            list(client.generate(PROMPT + "When do you open?", max_tokens=3))
        assert first_tier.flush(10.0), "write-back did not finish"
        with tracer.start_as_current_span("client.second"), WorkerClient(second) as client:
            list(client.generate(PROMPT + "Is there rye?", max_tokens=3, placement=[node]))
        assert second_tier.flush(10.0), "write-back did not finish"
        gateway = serve_gateway(stack, address)
        with tracer.start_as_current_span("client.third"):
            headers = {"Content-Type": "application/json"}
            propagate.inject(headers)
            body = {"model": "tiny", "prompt": PROMPT + "Do you bake on Sundays?", "max_tokens": 3}
            connection = http.client.HTTPConnection("127.0.0.1", gateway, timeout=60)
            connection.request("POST", "/v1/completions", json.dumps(body), headers)
            reply = connection.getresponse()
            assert reply.status == 200, reply.read()
            reply.read()
            connection.close()

        with Client([address]) as client:  # outside any trace: the coordinator starts one
            list(client.generate(PROMPT + "Do you bake on Sundays?", max_tokens=3))
        assert first_tier.flush(10.0), "write-back did not finish"
        unsampled = SpanContext(trace_id=0x5EED, span_id=0x1, is_remote=False, trace_flags=TraceFlags(0))
        with trace.use_span(NonRecordingSpan(unsampled)), Client([address]) as client:
            list(client.generate(PROMPT + "Any gluten-free bread?", max_tokens=3))
        assert first_tier.flush(10.0), "write-back did not finish"

        channel = stack.enter_context(observability.traced_channel(grpc.insecure_channel(address)))
        register = channel.unary_unary("/kvcache.v1.Coordinator/Register", pb.RegisterRequest.SerializeToString,
                                        pb.RegisterReply.FromString)
        heartbeat = channel.unary_unary("/kvcache.v1.Coordinator/Heartbeat", pb.HeartbeatRequest.SerializeToString,
                                        pb.HeartbeatReply.FromString)
        member = register(pb.RegisterRequest(role="node", address="127.0.0.1:9", capacity_bytes=page_bytes,
                                             page_bytes=page_bytes), timeout=10).member_id
        heartbeat(pb.HeartbeatRequest(member_id=member), timeout=10)
        with NodeClient(node) as node_client:
            node_client.info(timeout=10)
            node_client.stats(timeout=10)
    for record in received:
        print(json.dumps(record))
    for span in exporter.get_finished_spans():
        print(json.dumps({"name": span.name, "trace": format(span.context.trace_id, "032x"),
                          "id": format(span.context.span_id, "016x"),
                          "parent": format(span.parent.span_id, "016x") if span.parent else None,
                          "start": span.start_time, "end": span.end_time}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
