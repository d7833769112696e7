"""The coordinator's worker channels stay bounded as workers come and go on new addresses, and a
channel with a stream open is never closed under it; a draining worker's refusal reaches the relay
as such."""

import grpc
import pytest

from coordinator import workers
from coordinator.relay import AttemptFailed, ClientCall
from coordinator.workers import WorkerStreams
from protos import kvcache_pb2 as pb


class _Stream:
    """What a Generate call returns, without a worker: two replies, and cancel()."""

    def __init__(self):
        self.replies = iter([pb.GenerateReply(token_ids=[1]), pb.GenerateReply(finish_reason="length")])

    def __iter__(self):
        return self.replies

    def cancel(self):
        pass


def test_channels_past_the_bound_close_the_least_recently_used_idle_one(monkeypatch):
    closed = []
    monkeypatch.setattr(workers.WorkerClient, "close", lambda self: closed.append(self.address))
    monkeypatch.setattr(workers.WorkerClient, "generate_stream", lambda self, *a, **k: _Stream())
    call = ClientCall(lambda: None, lambda: True, lambda callback: True)
    streams = WorkerStreams(max_channels=4)
    busy = streams.open("127.0.0.1:1", pb.GenerateRequest(), 5.0, call)
    assert next(busy).token_ids == [1]  # a stream open on it until the end of the test
    for port in range(2, 12):
        assert len(list(streams.open(f"127.0.0.1:{port}", pb.GenerateRequest(), 5.0, call))) == 2
        assert streams.num_channels() <= 4
    assert "127.0.0.1:1" not in closed
    assert closed == [f"127.0.0.1:{port}" for port in range(2, 9)]  # the oldest idle ones first
    list(busy)
    streams.close()


def test_a_worker_shutting_down_says_so_in_its_trailer_and_the_relay_sees_it():
    """A real WorkerService over gRPC: a call refused while draining ends UNAVAILABLE with
    worker.client.DRAINING_KEY, which WorkerStreams hands the relay as AttemptFailed.draining."""
    from base import serving
    from worker.service import SERVICE_NAME, WorkerService, handler

    service = WorkerService(engine=None)  # refused before the engine is asked anything
    service.accepting = False
    server, health = serving.make_server([handler(service)], [SERVICE_NAME])
    port = serving.bind(server, "127.0.0.1", 0)
    server.start()
    streams = WorkerStreams()
    try:
        call = ClientCall(lambda: None, lambda: True, lambda callback: True)
        with pytest.raises(AttemptFailed) as failed:
            list(streams.open(f"127.0.0.1:{port}", pb.GenerateRequest(prompt="hi", max_tokens=1), 5.0, call))
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE and failed.value.draining
        assert "shutting down" in failed.value.details  # still said for people
    finally:
        streams.close()
        serving.stop(server, health, 0.5)
