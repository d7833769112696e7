"""A coordinator's capacity and status codes, with a real coordinator process and fake
workers: streams past --max-streams are refused at once while membership calls still get
threads; busy workers are skipped; a client's deadline is the worker's and kills no one."""

from __future__ import annotations

import time

import grpc
import pytest

from cluster_helpers import collect, run_kvcache, wait_for
from coordinator.capacity import StreamSlots
from coordinator.client import Client, ClusterError
from coordinator_fakes import alive_workers, coordinator_process, fake_worker, generate_stub
from protos import kvcache_pb2 as pb

HELD_S = 5.0  # longer than a member may go without a beat (4 s)


def test_stream_slots_refuse_past_the_limit_and_log_refusals_at_most_once_an_interval():
    now = [0.0]
    slots = StreamSlots(2, clock=lambda: now[0])
    assert slots.try_acquire() and slots.try_acquire() and not slots.try_acquire()
    assert slots.take_refusals_to_log() == 1
    assert not slots.try_acquire() and slots.take_refusals_to_log() == 0  # within the interval: silent
    now[0] += 11.0
    assert slots.take_refusals_to_log() == 1
    slots.release()
    assert slots.try_acquire() and slots.in_use() == 2
    with pytest.raises(ValueError, match="at least 1"):
        StreamSlots(0)


@pytest.fixture
def coordinator(tmp_path):
    with coordinator_process(tmp_path / "coordinator.log", "--max-streams", "2") as daemon:
        yield daemon


def test_streams_past_the_limit_are_refused_at_once_while_members_keep_beating(coordinator):
    with fake_worker([coordinator.address], mode="hold") as worker, grpc.insecure_channel(coordinator.address) as ch:
        assert wait_for(lambda: alive_workers(coordinator.address) == [worker.address], timeout_s=10.0)
        generate = generate_stub(ch)
        held = [generate(pb.GenerateRequest(prompt=f"hold {i}", max_tokens=5, request_id="same"), timeout=20.0)
                for i in range(2)]
        assert [next(stream).token_ids for stream in held] == [[1], [1]]
        with pytest.raises(grpc.RpcError) as refused:
            next(generate(pb.GenerateRequest(prompt="one more", max_tokens=5), timeout=20.0))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at its limit of 2 streams" in refused.value.details()
        # Both stream threads are taken for longer than a member may go without a beat.
        deadline = time.monotonic() + HELD_S
        while time.monotonic() < deadline:
            assert alive_workers(coordinator.address) == [worker.address]
            time.sleep(0.2)
        worker.release.set()
        assert [[r.finish_reason for r in stream][-1] for stream in held] == ["length", "length"]
        ids = [seen.request_id for seen in worker.seen]
        assert len(ids) == 2 and ids[0] != ids[1] and all(i.startswith("same.") for i in ids)
        with Client([coordinator.address]) as client:  # the slots came back
            assert collect(client.generate("after", max_tokens=5))[1].finish_reason == "length"
    assert "missed its heartbeats" not in coordinator.log_path.read_text()


def test_a_busy_worker_is_skipped_and_every_worker_busy_is_resource_exhausted(coordinator):
    with fake_worker([coordinator.address], mode="serve") as one, \
            fake_worker([coordinator.address], mode="serve") as two:
        assert wait_for(lambda: len(alive_workers(coordinator.address)) == 2, timeout_s=10.0)
        # An idle coordinator routes a fresh prompt to the lowest address first: make that one busy.
        first, second = sorted([one, two], key=lambda w: w.address)
        first.mode = "busy"
        with Client([coordinator.address]) as client:
            tokens, done = collect(client.generate("hello", max_tokens=4, request_id="mine"))
            assert tokens == [100, 101, 102, 103] and done.finish_reason == "length"
            assert [s.request_id for s in first.seen] != [s.request_id for s in second.seen]
            assert len(first.seen) == len(second.seen) == 1
            assert all(s.request_id.startswith("mine.") for s in first.seen + second.seen)
            second.mode = "busy"
            with pytest.raises(ClusterError) as refused:
                list(client.generate("hello again", max_tokens=4))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "all workers are busy" in refused.value.details
        assert alive_workers(coordinator.address) == sorted([one.address, two.address])
    log = coordinator.log_path.read_text()
    assert "unreachable" not in log and "missed its heartbeats" not in log


def test_the_clients_deadline_goes_to_the_worker_and_marks_no_one_dead(coordinator):
    with fake_worker([coordinator.address], mode="hold") as worker, grpc.insecure_channel(coordinator.address) as ch:
        assert wait_for(lambda: alive_workers(coordinator.address) == [worker.address], timeout_s=10.0)
        stream = generate_stub(ch)(pb.GenerateRequest(prompt="slow", max_tokens=5), timeout=1.5)
        with pytest.raises(grpc.RpcError) as late:
            list(stream)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(worker.seen) == 1 and worker.seen[0].time_remaining < 3.0  # not the 600 s request timeout
        assert alive_workers(coordinator.address) == [worker.address]
    log = coordinator.log_path.read_text()
    assert "unreachable" not in log and "missed its heartbeats" not in log


def test_a_bad_stream_limit_is_refused_in_one_line():
    done = run_kvcache(["coordinator", "--port", "0", "--max-streams", "0"])
    assert done.returncode == 2 and "--max-streams must be at least 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
