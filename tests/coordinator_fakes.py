"""For coordinator tests: a real `kvcache coordinator` process, and a fake Worker service in
this process that registers and beats like a worker and answers Generate as the test says
(serve, busy, hold), recording the request id and the deadline of every call it gets."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc

from base import serving
from base.member import MembershipAgent
from coordinator.client import Client
from kvcache.launch import Daemon
from protos import kvcache_pb2 as pb

HOLD_LIMIT_S = 15.0  # a held stream ends by itself after this, whatever the test does
BUSY_MESSAGE = "worker busy: no room for another stream"


@dataclass
class Seen:
    request_id: str
    time_remaining: float


class FakeWorker:
    def __init__(self, mode: str = "serve", tokens: int = 4):
        self.mode = mode  # serve: stream `tokens` tokens; busy: RESOURCE_EXHAUSTED; hold: one token, then wait
        self.tokens = tokens
        self.seen: list[Seen] = []
        self.release = threading.Event()
        self.address = ""

    def generate(self, request, context):
        self.seen.append(Seen(request.request_id, context.time_remaining()))
        if self.mode == "busy":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, BUSY_MESSAGE)
        if self.mode == "hold":
            yield pb.GenerateReply(text="a", token_ids=[1])
            self.release.wait(timeout=min(HOLD_LIMIT_S, context.time_remaining()))
        for token in range(self.tokens):
            yield pb.GenerateReply(text="b", token_ids=[100 + token])
        yield pb.GenerateReply(finish_reason="length", usage=pb.Usage(prompt_tokens=3, completion_tokens=self.tokens))

    def handler(self) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(self.generate, pb.GenerateRequest.FromString,
                                                      pb.GenerateReply.SerializeToString)
        return grpc.method_handlers_generic_handler("kvcache.v1.Worker", {"Generate": method})


@contextlib.contextmanager
def fake_worker(coordinators: list[str], mode: str = "serve", tokens: int = 4) -> Iterator[FakeWorker]:
    """A FakeWorker on 127.0.0.1, registered with `coordinators` until the block ends."""
    worker = FakeWorker(mode, tokens)
    server, health = serving.make_server([worker.handler()], ["kvcache.v1.Worker"], max_workers=16)
    port = serving.bind(server, "127.0.0.1", 0)
    server.start()
    worker.address = f"127.0.0.1:{port}"
    agent = MembershipAgent(coordinators, pb.RegisterRequest(role="worker", address=worker.address, model="fake"),
                            lambda: pb.MemberLoad())
    agent.start()
    try:
        yield worker
    finally:
        worker.release.set()
        agent.stop()
        serving.stop(server, health, 0.5)


@contextlib.contextmanager
def coordinator_process(log_path: Path, *args: str) -> Iterator[Daemon]:
    """`kvcache coordinator --port 0 ...`, stopped by its own pid when the block ends."""
    daemon = Daemon("coordinator", ["--host", "127.0.0.1", "--port", "0", *args], log_path=log_path, timeout_s=30.0)
    try:
        yield daemon
    finally:
        daemon.stop(timeout_s=5.0)


def alive_workers(coordinator: str) -> list[str]:
    with Client([coordinator]) as client:
        return sorted(m.address for m in client.status().members if m.role == "worker" and m.alive)


def generate_stub(channel: grpc.Channel):
    return channel.unary_stream("/kvcache.v1.Coordinator/Generate", pb.GenerateRequest.SerializeToString,
                                pb.GenerateReply.FromString)
