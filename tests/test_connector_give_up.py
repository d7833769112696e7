"""Loads given up before they started (worker/connector/loads.py: Loads.give_up): the
loader never runs them, and their blocks come back at the next step, while a load that started
keeps its blocks until it ends."""

import threading
import time

import pytest

from worker.connector.connector import Tier
from worker.engine.engine import Engine
from worker.model import load_model

SHARED = "You are a helpful assistant. Answer briefly, and cite what you read. "  # 4 full pages of 16 tokens
PARKED = 5


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class SlowFirstTier(Tier):
    """A tier that finds every page; its first fill waits for the test, and it counts its fills."""

    def __init__(self):
        self.fills, self.entered, self.release = [], threading.Event(), threading.Event()

    def lookup(self, keys, context):
        return len(keys)

    def fill(self, keys, block_ids, context):
        self.fills.append(list(keys))
        if len(self.fills) == 1:
            self.entered.set()
            self.release.wait(30.0)  # bounded, released by the test
        return 0  # nothing landed: computed

    def on_page_full(self, key, parent, block_id, context):
        pass


def prompt(i):
    return f"Preamble {i}. " + SHARED + "What does a kvnode store?"


def step_until(engine, predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        engine.step()


def parked_behind_a_slow_load(tiny, tier, **options):
    """An engine over `tier` with PARKED requests parked, the first one's load running."""
    engine = Engine(tiny, num_blocks=256, page_tokens=16, max_num_batched_tokens=256, seed=0)
    engine.attach_remote_tier(tier)
    for name, value in options.items():
        setattr(engine.connector, name, value)
    handles = [engine.add_request(prompt(i), max_new_tokens=4, ignore_eos=True, request_id=f"r{i}")
               for i in range(PARKED)]
    step_until(engine, lambda: len(engine.scheduler.parked) == PARKED)
    assert tier.entered.wait(5.0)
    return engine, handles


def test_loads_aborted_before_they_started_never_run_and_free_their_blocks_at_the_next_step(tiny):
    tier = SlowFirstTier()
    engine, _ = parked_behind_a_slow_load(tiny, tier)
    try:
        first_blocks = len(engine.scheduler.parked[0].block_table)
        for i in range(PARKED):
            assert engine.abort(f"r{i}")
        engine.step()
        # The first load still runs: its blocks stay the loader's; the others' are free already.
        assert engine.get_num_free_blocks() == engine.pool.num_blocks - first_blocks
    finally:
        tier.release.set()
    step_until(engine, lambda: engine.get_num_free_blocks() == engine.pool.num_blocks)
    assert len(tier.fills) == 1, f"{len(tier.fills) - 1} loads of aborted requests still ran"
    assert engine.connector.num_loads_cancelled == PARKED - 1
    assert engine.connector.num_pending() == 0
    engine.pool.check_invariants()


def test_overdue_loads_not_started_are_cancelled_and_their_requests_computed(tiny):
    """Overdue is measured from when the load was asked for (take_finished_loads): the loads queued behind the
    slow one are overdue with it, given up without running, and their requests computed."""
    colds = [out.token_ids for out in Engine(tiny, num_blocks=256, page_tokens=16, seed=0).generate(
        [prompt(i) for i in range(PARKED)], max_new_tokens=4, ignore_eos=True)]
    tier = SlowFirstTier()
    engine, handles = parked_behind_a_slow_load(tiny, tier, timeout_s=0.3)
    try:
        step_until(engine, lambda: all(handle.completion is not None for handle in handles))
        assert [handle.completion.token_ids for handle in handles] == colds
        assert engine.connector.num_loads_given_up == PARKED
    finally:
        tier.release.set()
    step_until(engine, lambda: engine.get_num_free_blocks() == engine.pool.num_blocks)
    assert len(tier.fills) == 1, f"{len(tier.fills) - 1} loads given up before they started still ran"
    assert engine.connector.num_loads_cancelled == PARKED - 1
    engine.pool.check_invariants()
