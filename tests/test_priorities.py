"""Priorities (worker/engine/priority.py): a high-priority request's time to first token,
in engine steps, is the same behind a queue of low-priority requests as alone; it preempts them for a
seat or for blocks, never the other way; aging lets a low-priority request through a stream of
high-priority ones; and every answer is the one it gives alone."""

import pytest

from engine_helpers import make_engine

LOW, HIGH = 5, 0
HIGH_PROMPT = "the important question, asked " * 2  # 60 tokens: longer than every low one


def steps_to_first_token(engine, handle, limit=200):
    for steps in range(1, limit + 1):
        engine.step()
        if handle.completion is not None or handle.queue.qsize():
            return steps
    raise AssertionError(f"no first token in {limit} steps")


def alone(prompt, **options):
    return make_engine(num_blocks=64).generate([prompt], **options)[0]


# seats: 4 seats, blocks to spare; blocks: 8 seats, a pool the low-priority requests fill.
@pytest.mark.parametrize("limit", ["seats", "blocks"])
def test_a_high_priority_request_starts_as_soon_behind_a_queue_of_low_priority_ones(limit):
    options = dict(num_blocks=40, max_seqs=4) if limit == "seats" else dict(num_blocks=22, max_seqs=8)
    lone = make_engine(**options)
    baseline = steps_to_first_token(lone, lone.add_request(HIGH_PROMPT, max_new_tokens=5, priority=HIGH))

    results = {}
    for high_priority in (HIGH, LOW):  # the same request, with and without its priority
        engine = make_engine(**options)
        low = [engine.add_request(f"low {i} " + "x" * 12, max_new_tokens=40, ignore_eos=True, priority=LOW)
               for i in range(10)]
        for _ in range(6):
            engine.step()
        assert engine.num_running() >= 4 and engine.num_waiting() >= 2  # seats or blocks taken by low ones
        high = engine.add_request(HIGH_PROMPT, max_new_tokens=5, priority=high_priority)
        results[high_priority] = steps_to_first_token(engine, high)
        while engine.has_unfinished():
            engine.step()
        engine.pool.check_invariants()
        assert high.completion.token_ids == alone(HIGH_PROMPT, max_new_tokens=5).token_ids
        for i, handle in enumerate(low):  # preempted and recomputed, with the same tokens
            assert handle.completion.finish_reason == "length"
            assert handle.completion.token_ids == alone(f"low {i} " + "x" * 12, max_new_tokens=40,
                                                        ignore_eos=True).token_ids
        if high_priority == HIGH:
            assert sum(h.completion.num_preemptions for h in low) >= 1
            assert high.completion.num_preemptions == 0

    assert results[HIGH] == baseline, f"first token after {results[HIGH]} steps, alone after {baseline}"
    assert results[LOW] > baseline + 5  # without its priority it waits for the queue


def test_a_high_priority_request_whose_prefix_is_cached_preempts_for_the_blocks_past_it():
    """Its idle cached prefix counts among the pool's free blocks but is no room for its chunk:
    preemption makes room past it (it used to wait 26 steps, until the low one had grown)."""
    prefix, question, low_prompt = "a shared prefix, cached, ", "q" * 24, "z" * 78
    lone = make_engine(num_blocks=16)
    lone.generate([prefix], max_new_tokens=1)
    baseline = steps_to_first_token(lone, lone.add_request(prefix + question, max_new_tokens=2, priority=HIGH))

    engine = make_engine(num_blocks=16)
    engine.generate([prefix], max_new_tokens=1)  # its pages stay cached, idle
    low = engine.add_request(low_prompt, max_new_tokens=30, ignore_eos=True, priority=LOW)
    for _ in range(3):
        engine.step()
    high = engine.add_request(prefix + question, max_new_tokens=2, priority=HIGH)
    steps = steps_to_first_token(engine, high)
    assert steps <= baseline + 1 and engine.scheduler.num_preemptions == 1, f"first token after {steps} steps"
    while engine.has_unfinished():
        engine.step()
    engine.pool.check_invariants()
    assert high.completion.token_ids == alone(prefix + question, max_new_tokens=2).token_ids
    assert low.completion.token_ids == alone(low_prompt, max_new_tokens=30, ignore_eos=True).token_ids


def test_aging_lets_a_low_priority_request_through_a_stream_of_high_priority_ones():
    aging_steps = 8
    engine = make_engine(max_seqs=1)
    engine.scheduler.priority.aging_steps = aging_steps
    first = engine.add_request("high 0 " + "y" * 10, max_new_tokens=6, ignore_eos=True, priority=HIGH)
    engine.step()
    low = engine.add_request("low one", max_new_tokens=3, ignore_eos=True, priority=LOW)
    highs = [first]
    for step in range(1, 200):
        if step % 2 == 0:  # a new high-priority request every other step: the seat is never free of them
            highs.append(engine.add_request(f"high {step} " + "y" * 10, max_new_tokens=6, ignore_eos=True,
                                            priority=HIGH))
        engine.step()
        if low.queue.qsize():
            break
    assert low.queue.qsize(), "the low-priority request never started"
    assert step <= aging_steps + 2 * 7, f"it started after {step} steps"  # aged, then the running one's end
    while engine.has_unfinished():
        engine.step()
    assert low.completion.token_ids == alone("low one", max_new_tokens=3, ignore_eos=True).token_ids


def test_priority_goes_through_a_coordinator_to_the_worker(tmp_path):
    """Real processes: a coordinator and a worker with one seat. A long low-priority request holds
    the seat; a request sent after its first token is scheduled before the low one's last step when
    it has the higher priority (it preempts it), and only after it with the same priority: so the
    coordinator passes `priority` on and the worker schedules by it. The order is read from the
    worker's step log (which requests each step ran), not from when replies reached the client."""
    import json
    import threading

    from cluster_helpers import collect
    from base.generation import Finished, Piece
    from coordinator.client import Client
    from kvcache.cluster import wait_healthy
    from kvcache.launch import Daemon

    low_prompt, high_prompt = "a long, unimportant story: " * 2, "the important question? " * 2
    step_log = tmp_path / "steps.jsonl"
    daemons, orders, seen = [], {}, {}
    try:
        daemons.append(Daemon("coordinator", ["--port", "0"], log_path=tmp_path / "coordinator.log"))
        coordinator = daemons[0].address
        daemons.append(Daemon("worker", ["--port", "0", "--coordinators", coordinator, "--model", "tiny",
                                         "--kv-cache", "8MiB", "--max-num-seqs", "1", "--blas-threads", "1",
                                         "--step-log", str(step_log)], log_path=tmp_path / "worker.log"))
        wait_healthy([coordinator], nodes=0, workers=1, timeout_s=60.0)
        with Client([coordinator], timeout=120.0) as client:
            for high_priority in (HIGH, LOW):
                # A round shows something only if the high request reached the worker while the low one
                # still ran (a busy machine can delay it past the low one's end): up to 3 tries.
                for attempt in range(3):
                    round_ = f"{high_priority}-{attempt}"
                    events, results, lock = [], {}, threading.Lock()
                    low_started = threading.Event()

                    def read(name, stream):
                        tokens = []
                        for event in stream:
                            if isinstance(event, Piece) and event.token_ids:
                                if not tokens:
                                    with lock:
                                        events.append((name, "first token"))
                                    if name == "low":
                                        low_started.set()
                                tokens.extend(event.token_ids)
                            elif isinstance(event, Finished):
                                with lock:
                                    events.append((name, "finished"))
                                results[name] = (tokens, event)

                    low_id, high_id = f"low{round_}", f"high{round_}"
                    low = threading.Thread(target=read, daemon=True, args=("low", client.generate(
                        low_prompt, max_tokens=400, ignore_eos=True, priority=LOW, request_id=low_id)))
                    low.start()
                    assert low_started.wait(60.0), "the low-priority request never started"
                    high = threading.Thread(target=read, daemon=True, args=("high", client.generate(
                        high_prompt, max_tokens=5, priority=high_priority, request_id=high_id)))
                    high.start()
                    for thread in (low, high):
                        thread.join(120.0)
                        assert not thread.is_alive(), "a request did not finish within 120 s"
                    assert set(results) == {"low", "high"}, events
                    assert results["low"][1].finish_reason == "length" and len(results["low"][0]) == 400
                    seen[high_priority] = events
                    records = [json.loads(line) for line in step_log.read_text().splitlines()]
                    steps = [[r["id"].split(".")[0] for r in record["requests"]] for record in records]
                    high_first = min(i for i, ids in enumerate(steps) if high_id in ids)
                    low_last = max(i for i, ids in enumerate(steps) if low_id in ids)
                    high_arrived = next(r["arrived"] for r in records[high_first]["requests"]
                                        if r["id"].split(".")[0] == high_id)
                    alone_tokens, _ = collect(client.generate(high_prompt, max_tokens=5, priority=high_priority))
                    assert results["high"][0] == alone_tokens  # priority changes when, not what
                    if high_arrived < records[low_last]["time"]:
                        orders[high_priority] = "high started first" if high_first < low_last else "low finished first"
                        break
                else:
                    raise AssertionError(f"priority {high_priority}: in 3 tries the low request always finished "
                                         "before the high one reached the worker; nothing was shown")
    finally:
        for daemon in reversed(daemons):
            daemon.stop(timeout_s=10.0)
    assert orders == {HIGH: "high started first", LOW: "low finished first"}, orders
    # seen by the client too, when the low request had hundreds of tokens to go
    assert seen[HIGH].index(("high", "first token")) < seen[HIGH].index(("low", "finished")), seen[HIGH]
