"""200 concurrent streams through two coordinators to real workers and a kvnode (tiny model):
every stream completes with the right tokens or is refused with RESOURCE_EXHAUSTED (and
retried), and no member is ever marked dead, because heartbeats keep threads of their own."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from coordinator.client import Client
from kvcache.cluster import start_cluster, wait_healthy
from protos import kvcache_pb2 as pb
from worker.engine.engine import Engine

STREAMS = 200
MAX_TOKENS = 128
TRIES = 30  # per stream, after RESOURCE_EXHAUSTED
RUN_LIMIT_S = 240.0
PROMPTS = [f"Customer {i}: what bread do you have today?" for i in range(4)]


async def _stream(stub, prompt: str) -> tuple[str, list[int], int]:
    """("completed", tokens, refusals) or ("refused"/"failed: ...", [], refusals)."""
    refusals = 0
    for _ in range(TRIES):
        request = pb.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, request_id="load")
        tokens: list[int] = []
        try:
            async for reply in stub(request, timeout=120.0):
                tokens.extend(reply.token_ids)
                if reply.finish_reason:
                    return "completed", tokens, refusals
            return "failed: the stream ended without finishing", tokens, refusals
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                return f"failed: {exc.code().name}: {exc.details()}", tokens, refusals
            refusals += 1
            await asyncio.sleep(0.2)
    return "refused", [], refusals


async def _load(coordinators: list[str]) -> list[tuple[str, list[int], int]]:
    channels = [grpc.aio.insecure_channel(address) for address in coordinators]
    try:
        stubs = [ch.unary_stream("/kvcache.v1.Coordinator/Generate", pb.GenerateRequest.SerializeToString,
                                 pb.GenerateReply.FromString) for ch in channels]
        streams = [_stream(stubs[i % len(stubs)], PROMPTS[i % len(PROMPTS)]) for i in range(STREAMS)]
        return await asyncio.wait_for(asyncio.gather(*streams), timeout=RUN_LIMIT_S)
    finally:
        for ch in channels:
            await ch.close()


def _watch(coordinators: list[str], stop: threading.Event, dead: list[str], beats: list[float]) -> None:
    """Every member as each coordinator sees it, every 0.25 s until `stop`."""
    clients = [Client([address]) for address in coordinators]
    try:
        while not stop.wait(0.25):
            for client in clients:
                for member in client.status(timeout=5.0).members:
                    beats.append(member.seconds_since_beat)
                    if not member.alive:
                        dead.append(f"{member.role} {member.address}")
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def expected():
    engine = Engine.load("tiny")
    return {p: engine.generate(p, max_new_tokens=MAX_TOKENS, ignore_eos=True)[0].token_ids for p in PROMPTS}


def test_200_streams_through_two_coordinators_never_mark_a_member_dead(tmp_path, expected):
    with start_cluster(tmp_path, nodes=1, workers=2, coordinators=2, replicas=1, node_capacity="16MiB",
                       worker_kv_cache="16MiB") as cluster:
        coordinators = cluster.coordinator_addresses
        wait_healthy(coordinators, nodes=1, workers=2)
        stop, dead, beats = threading.Event(), [], []
        watcher = threading.Thread(target=_watch, args=(coordinators, stop, dead, beats), daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            results = asyncio.run(_load(coordinators))
        finally:
            stop.set()
            watcher.join(timeout=10.0)
        elapsed = time.monotonic() - started
        logs = [d.log_path.read_text() for d in cluster.role("coordinator")]
    outcomes = [outcome for outcome, _, _ in results]
    completed = outcomes.count("completed")
    print(f"\n{STREAMS} streams in {elapsed:.1f}s: {completed} completed, {outcomes.count('refused')} refused, "
          f"{sum(r for _, _, r in results)} refusals retried; longest silence seen {max(beats, default=0):.2f}s")
    assert [o for o in outcomes if o not in ("completed", "refused")] == []
    assert completed > 0
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(STREAMS)]
    wrong = [i for i, (outcome, tokens, _) in enumerate(results) if outcome == "completed" and
             tokens != expected[prompts[i]]]
    assert wrong == []
    assert dead == [] and not watcher.is_alive()
    for log in logs:
        assert "missed its heartbeats" not in log and "unreachable" not in log
