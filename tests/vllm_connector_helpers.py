"""What the vllm_connector tests share: a layout of small pages, test engines built of the connector's
two sides as connector.py builds them (vLLM's memory being plain NumPy arrays), and the calls vLLM
makes, driven by hand: polling a lookup, allocating, starting loads, saving after a step.

Every wait is bounded; an engine's threads and clients are closed when its block ends."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator, Sequence

import numpy as np
import pytest

from vllm_connector.keys import BlockLayout
from vllm_connector.placement import Placement
from vllm_connector.plan import StepPlan
from vllm_connector.scheduler_side import SchedulerSide
from vllm_connector.settings import Settings
from vllm_connector.worker_side import WorkerSide
from worker.remote.nodes import NodeTable

BLOCK_SIZE = 16
NUM_LAYERS = 4
PAGE_BYTES = 4096  # k and v of 16 tokens x 2 heads x 32 dims in bfloat16
NUM_BLOCKS = 24    # vLLM's blocks in each test engine
LAYOUT = BlockLayout(model="test/tiny-llama", model_config='{"num_hidden_layers": 4}', kv_dtype="torch.bfloat16",
                     block_size=BLOCK_SIZE, num_layers=NUM_LAYERS, num_kv_heads=2, head_size=32,
                     page_bytes=PAGE_BYTES, platform="cpu", engine_version="0.0.test")
POLL_S = 0.005
NODE_ARGS = ("--capacity", "4MiB", "--page-bytes", str(PAGE_BYTES))


def settings(address: str | Sequence[str], **extra) -> Settings:
    addresses = [address] if isinstance(address, str) else list(address)
    return Settings.from_extra_config({"kvnodes": addresses, **extra})


def node_table() -> NodeTable:
    """As connector.py makes them, with a shorter Info timeout (a test's nodes are on loopback)."""
    return NodeTable(PAGE_BYTES, 1.0, 2.0, 60.0, 256, max_probes=4)


def random_layers(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(NUM_BLOCKS, PAGE_BYTES), dtype=np.uint8) for _ in range(NUM_LAYERS)]


def zero_layers() -> list[np.ndarray]:
    return [np.zeros((NUM_BLOCKS, PAGE_BYTES), dtype=np.uint8) for _ in range(NUM_LAYERS)]


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, size=n).tolist()


def blocks(layers: list[np.ndarray], block_ids: Sequence[int]) -> np.ndarray:
    """(layers, blocks, page_bytes): what vLLM holds in these blocks."""
    return np.stack([layer[list(block_ids)] for layer in layers])


class Engine:
    """One vLLM engine's connector: a scheduler side and a worker side, each with its own node table."""

    def __init__(self, settings_: Settings, layers: list[np.ndarray]):
        self.settings = settings_
        self.layers = layers
        self.placement = Placement(settings_, PAGE_BYTES)
        self.scheduler = SchedulerSide(settings_, LAYOUT, self.placement, node_table())
        self.worker = WorkerSide(settings_, node_table(), layers)

    def matched(self, req_id: str, prompt: Sequence[int], salt: str = "", local: int = 0,
                timeout_s: float = 5.0) -> tuple[int, bool]:
        """get_num_new_matched_tokens as vLLM calls it: again each step while it answers None."""
        deadline = time.monotonic() + timeout_s
        while True:
            num, is_async = self.scheduler.num_new_matched_tokens(req_id, prompt, salt, local)
            if num is not None:
                return num, is_async
            assert time.monotonic() < deadline, f"the lookup of {req_id} still answers None after {timeout_s} s"
            time.sleep(POLL_S)

    def save(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], salt: str = "",
             computed: int = 0, timeout_s: float = 10.0) -> StepPlan:
        """A request's first step computing the whole prompt, then its blocks saved and sent."""
        self.scheduler.start(req_id, prompt, salt, block_ids, computed)
        plan = self.scheduler.plan({req_id: len(prompt)})
        self.worker.save(plan.saves)
        assert self.worker.wait_for_saves(timeout_s), "the saves were not sent in time"
        return plan

    def load(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], salt: str = "", local: int = 0,
             timeout_s: float = 10.0) -> tuple[int, set[int], float]:
        """Lookup, allocation and the load that follows: (tokens matched, blocks in error, seconds the load took)."""
        num, _ = self.matched(req_id, prompt, salt, local)
        self.scheduler.after_alloc(req_id, block_ids, num)
        plan = self.scheduler.plan({})
        if not plan.loads:
            return num, set(), 0.0
        errors, seconds = self.run_loads(plan, {req_id}, timeout_s)
        return num, errors, seconds

    def run_loads(self, plan: StepPlan, req_ids: set[str], timeout_s: float = 10.0) -> tuple[set[int], float]:
        """start_load_kv, then get_finished each step until every request of `req_ids` is reported."""
        started = time.monotonic()
        self.worker.start_loads(plan.loads)
        done, errors = set(), set()
        while not req_ids <= done:
            assert time.monotonic() - started < timeout_s, f"loads of {req_ids - done} not reported in {timeout_s} s"
            time.sleep(POLL_S)
            finished, failed = self.worker.take_finished_loads()
            done |= finished
            errors |= failed
        return errors, time.monotonic() - started

    def close(self) -> None:
        self.worker.close()
        self.worker.nodes.close()
        self.scheduler.close()
        self.scheduler.nodes.close()
        self.placement.close()


@contextlib.contextmanager
def engine(settings_: Settings, layers: list[np.ndarray] | None = None) -> Iterator[Engine]:
    e = Engine(settings_, zero_layers() if layers is None else layers)
    try:
        yield e
    finally:
        e.close()


@pytest.fixture(autouse=True)
def no_errors_logged(caplog):
    """Whatever fails is a warning and a recomputed block, never an error with a traceback."""
    with caplog.at_level(logging.INFO):
        yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
