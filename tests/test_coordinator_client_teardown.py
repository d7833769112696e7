"""coordinator.client.Client leaves no gRPC object for the interpreter's exit (Client.close): a call
or channel freed by the last garbage collection at exit, after grpc's daemon threads were
stopped where they stood, waits forever for a lock such a thread held. Seen in
test_netns_partition's resumed request: its client printed the whole answer and never exited
(the main thread in grpc's _Rendezvous.__del__, 'Garbage-collecting'). The hang itself is a rare
race; these check that nothing is left for that collection, with the collector off meanwhile."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

import grpc
import pytest

from base import serving
from base.generation import Finished, Piece
from coordinator.client import Client
from worker.client import WorkerClient, WorkerError
from protos import kvcache_pb2 as pb


def failing(request, context):  # one token, then the coordinator is gone
    yield pb.GenerateReply(text="a", token_ids=[1])
    context.abort(grpc.StatusCode.UNAVAILABLE, "partitioned")


def finishing(request, context):
    yield pb.GenerateReply(text="b", token_ids=[2])
    yield pb.GenerateReply(finish_reason="length", usage=pb.Usage(prompt_tokens=3, completion_tokens=2))


@contextlib.contextmanager
def fake_coordinator(generate, service: str = "kvcache.v1.Coordinator") -> Iterator[str]:
    method = grpc.unary_stream_rpc_method_handler(generate, pb.GenerateRequest.FromString,
                                                  pb.GenerateReply.SerializeToString)
    handler = grpc.method_handlers_generic_handler(service, {"Generate": method})
    server, health = serving.make_server([handler], [service], max_workers=4)
    port = serving.bind(server, "127.0.0.1", 0)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        serving.stop(server, health, 0.5)


@contextlib.contextmanager
def collector_off():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def alive(kind: type) -> list:
    """Every object of `kind` alive now. By type(), not isinstance(), which asks each object for its
    __class__: openai's lazy module proxies (the gateway tests import openai) then import their
    modules, seconds of it."""
    return [o for o in gc.get_objects() if issubclass(type(o), kind)]


def made_since(before: list, kind: type) -> list:
    """Objects of `kind` alive now that were not in `before` (kept alive there, so ids stay unique)."""
    old = {id(o) for o in before}
    return [o for o in alive(kind) if id(o) not in old]


@pytest.mark.parametrize("order", ["resumed", "first"])
def test_no_call_outlives_generate_even_after_a_coordinator_failed_mid_stream(order):
    with fake_coordinator(failing) as gone, fake_coordinator(finishing) as serving_one:
        coordinators = [gone, serving_one] if order == "resumed" else [serving_one]
        with Client(coordinators, timeout=30.0) as client, collector_off():
            before = alive(grpc.Call)
            events = list(client.generate([1, 2, 3], temperature=0.0, max_tokens=2))
            left = made_since(before, grpc.Call)
        assert [type(e) for e in events][-1] is Finished
        tokens = [t for e in events if isinstance(e, Piece) for t in e.token_ids]
        assert tokens == ([1, 2] if order == "resumed" else [2])  # resumed after the failed one's token
        assert left == [], f"{len(left)} gRPC call(s) left for a garbage collection to free"


def test_close_lets_go_of_the_channels_and_a_closed_client_says_so():
    with fake_coordinator(finishing) as address, collector_off():
        before = alive(grpc.Channel)
        client = Client([address, "127.0.0.1:9"], timeout=30.0)
        assert [type(e) for e in client.generate([1], temperature=0.0)][-1] is Finished
        client.close()
        assert made_since(before, grpc.Channel) == []
        client.close()  # twice is harmless
        with pytest.raises(ValueError, match="closed"):
            list(client.generate([1]))
        with pytest.raises(ValueError, match="closed"):
            client.status()


def test_no_call_outlives_a_worker_stream_that_failed():
    """`kvcache generate --worker` meets the same exit with WorkerClient's error in hand."""
    with fake_coordinator(failing, "kvcache.v1.Worker") as worker, WorkerClient(worker, timeout=30.0) as client, \
            collector_off():
        before = alive(grpc.Call)
        with pytest.raises(WorkerError) as failed:
            list(client.generate([1, 2, 3], max_tokens=2))
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        del failed
        left = made_since(before, grpc.Call)
    assert left == [], f"{len(left)} gRPC call(s) left for a garbage collection to free"
