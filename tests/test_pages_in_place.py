"""Fetched pages read where they lie (worker/kv/pages_in_place.py, worker/engine/in_place_joins.py): a request's
first step reads its prefix out of a node's pool mapped into the engine's block arena, the next
step copies it into the request's blocks and gives the pins back.

These tests use a tier of their own whose "node pool" is a memfd in this process: the engine's
side (arena, connector, scheduler, forward) is what they test; tests/test_data_plane_shared_pool.py
runs the whole path against a real kvnode."""

import mmap
import os
import time
from concurrent.futures import Future

import dataclasses

import numpy as np
import pytest

from worker.kv.block_arena import BlockArena
from worker.connector.connector import Tier
from worker.engine.engine import Engine
from worker.model import ARCH_MODULES, PRESET_SEEDS, Model, load_model, random_tensors
from worker.kv.pages_in_place import PagesInPlace

PROMPT = "You are a helpful assistant. Answer briefly, and cite what you read. What does a kvnode store?"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class PoolTier(Tier):
    """A remote tier whose pages lie in a memfd "pool" (slots in reverse order of arrival), read in
    place through the reader's arena; `fill` copies, for the writer and the fallback."""

    def __init__(self, pages=32):
        self.pages = {}  # key -> slot
        self.slots = pages
        self.fd = None
        self.window = None
        self.released = 0
        self.fills = 0
        self.in_place = True
        self.altered = None  # index of the page the check finds altered, or None

    def pool_of(self, page_bytes):
        if self.fd is None:
            self.fd = os.memfd_create("test-pool")
            os.ftruncate(self.fd, self.slots * page_bytes)
            self.map = mmap.mmap(self.fd, self.slots * page_bytes)
            self.array = np.frombuffer(self.map, dtype=np.uint8).reshape(self.slots, page_bytes)
        return self.array

    def on_page_full(self, key, parent, block_id, context):
        engine = context
        pool = self.pool_of(engine.kv_pool[0].nbytes)
        if key not in self.pages:
            slot = self.slots - 1 - len(self.pages)
            pool[slot] = engine.kv_pool[block_id].reshape(-1).view(np.uint8)
            self.pages[key] = slot

    def lookup(self, keys, context):
        count = 0
        for key in keys:
            if key not in self.pages:
                break
            count += 1
        return count

    def fill(self, keys, block_ids, context):
        self.fills += 1
        for key, block in zip(keys, block_ids):
            context.kv_pool[block].reshape(-1).view(np.uint8)[:] = self.array[self.pages[key]]
        return len(keys)

    def fill_in_place(self, keys, block_ids, context):
        if not self.in_place:
            return None
        arena = context.pool.arena
        if self.window is None:
            self.window = arena.attach(self.fd, self.slots, self.array.shape[1], generation=1)
        arena.pin(self.window)

        def release():
            self.released += 1
            arena.unpin(self.window)

        checked = Future()
        checked.set_result(self.altered)
        return PagesInPlace(block_ids, [self.window.first_block + self.pages[key] for key in keys], release, checked)


class Reader:
    """An engine reading through a PoolTier; its tier context is itself, so the tier finds its arena."""

    def __init__(self, model, tier):
        self.engine = Engine(model, num_blocks=64, page_tokens=16, max_num_batched_tokens=256, seed=0)
        self.engine.attach_remote_tier(tier)

    def generate(self, prompt, **options):
        return self.engine.generate(prompt, tier_context=self.engine, **options)[0]


def test_the_first_step_reads_the_pages_in_place_and_the_next_copies_them_in(tiny):
    tier = PoolTier()
    writer = Reader(tiny, tier)
    cold = writer.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert len(tier.pages) >= 4
    reader = Reader(tiny, tier)
    warm = reader.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert warm.token_ids == cold.token_ids
    prompt_pages = warm.usage.prompt_tokens // 16
    assert prompt_pages >= 4 and warm.usage.cached_tokens_remote == prompt_pages * 16
    assert tier.fills == 0 and tier.released == 1
    keys = list(tier.pages)[:prompt_pages]  # the prompt's, in order (the writer's decode filled one more)
    blocks = reader.engine.pool.lookup(keys)
    assert len(blocks) == len(keys), "the pages were indexed in the local cache once copied in"
    for key, block in zip(keys, blocks):
        assert np.array_equal(reader.engine.kv_pool[block].reshape(-1).view(np.uint8), tier.array[tier.pages[key]])
    assert tier.window.pins == 0


def test_a_request_done_in_its_first_step_read_the_window_and_its_pages_are_cached_after(tiny):
    """One token: the request ends in the step that read its pages in place, its blocks still NaN
    then (the token can only be right if the forward read the window); the step after copies the
    pages into those blocks and caches them, so the same prompt is then a local hit."""
    tier = PoolTier()
    writer = Reader(tiny, tier)
    cold = writer.generate(PROMPT, max_new_tokens=1)
    reader = Reader(tiny, tier)
    reader.engine.kv_pool.fill(np.nan)  # whatever the forward read from the pool's own blocks would show
    warm = reader.generate(PROMPT, max_new_tokens=1)
    assert warm.token_ids == cold.token_ids and warm.usage.cached_tokens_remote > 0
    assert tier.released == 1 and tier.window.pins == 0
    keys = list(tier.pages)[: warm.usage.cached_tokens_remote // 16]
    blocks = reader.engine.pool.lookup(keys)
    assert len(blocks) == len(keys)
    for key, block in zip(keys, blocks):
        assert np.array_equal(reader.engine.kv_pool[block].reshape(-1).view(np.uint8), tier.array[tier.pages[key]])
    again = reader.generate(PROMPT, max_new_tokens=1)
    assert again.token_ids == cold.token_ids and tier.released == 1
    assert again.usage.cached_tokens_local == warm.usage.cached_tokens_remote
    reader.engine.pool.check_invariants()


def test_pages_held_too_long_are_not_copied_in(tiny, monkeypatch):
    """The node drops pins a reader holds past its timeout and may reuse the slots: pages read in
    place whose pins are older than LAND_WITHIN_S are given back uncopied, and a request that
    still needed them computes its prompt again."""
    import worker.kv.pages_in_place as in_place

    tier = PoolTier()
    writer = Reader(tiny, tier)
    cold = writer.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    reader = Reader(tiny, tier)
    handle = reader.engine.add_request(PROMPT, max_new_tokens=4, ignore_eos=True, tier_context=reader.engine)
    while not reader.engine.scheduler.in_place.num_reading():  # until its pages are read in place
        reader.engine.step()
    monkeypatch.setattr(in_place, "LAND_WITHIN_S", 0.0)  # as if the engine had not stepped for that long
    while handle.completion is None:
        reader.engine.step()
    assert handle.completion.token_ids == cold.token_ids
    assert tier.released == 1 and reader.engine.scheduler.in_place.num_discarded == 1
    reader.engine.pool.check_invariants()


def test_without_pages_in_place_the_pages_are_fetched_as_before(tiny):
    tier = PoolTier()
    writer = Reader(tiny, tier)
    cold = writer.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    tier.in_place = False
    reader = Reader(tiny, tier)
    assert reader.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids == cold.token_ids
    assert tier.fills == 1 and tier.released == 0


def test_the_arena_maps_a_pool_after_the_blocks_and_unmaps_it_once_unread():
    shape = (2, 2, 1, 16, 8)
    arena = BlockArena(3, shape, np.float32)
    page_bytes = arena.block_bytes
    fd = os.memfd_create("test-pool")
    try:
        os.ftruncate(fd, 4 * page_bytes)
        with mmap.mmap(fd, 4 * page_bytes) as pool:
            pool[2 * page_bytes : 3 * page_bytes] = np.full(page_bytes // 4, 7.0, dtype=np.float32).tobytes()
            window = arena.attach(fd, 4, page_bytes, generation=1)
            assert window.first_block >= 3
            assert (arena.all_blocks[window.first_block + 2] == 7.0).all()
            arena.local[:] = 1.0
            assert (arena.all_blocks[:3] == 1.0).all() and (arena.all_blocks[window.first_block + 2] == 7.0).all()
            with pytest.raises(ValueError, match="bytes"):
                arena.attach(fd, 4, page_bytes // 2, generation=2)
            assert arena.pin(window)
            arena.detach(window)
            assert (arena.all_blocks[window.first_block + 2] == 7.0).all(), "a pinned window stays mapped"
            assert not arena.pin(window)
            arena.unpin(window)
            again = arena.attach(fd, 4, page_bytes, generation=2)
            assert again.first_block == window.first_block, "the space of an unmapped window is used again"
    finally:
        os.close(fd)


@pytest.mark.parametrize("altered", [0, 2])
def test_pages_that_fail_their_check_throw_the_step_away_and_the_prompt_is_computed(tiny, altered):
    """The check runs beside the first forward; when page `altered` fails it, that forward's token
    is not used: the request computes its prompt again, reusing only the pages before that one
    (copied in first), and its answer is a cold run's."""
    tier = PoolTier()
    writer = Reader(tiny, tier)
    cold = writer.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    reader = Reader(tiny, tier)
    tier.altered = altered
    keys = list(tier.pages)[:5]
    slot = tier.pages[keys[altered]]
    tier.array[slot] ^= 1  # the page the check names, really altered: a forward that used it would show
    warm = reader.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert warm.token_ids == cold.token_ids
    assert reader.engine.scheduler.in_place.num_discarded == 1
    assert tier.released == 1 and tier.window.pins == 0
    assert warm.usage.cached_tokens_remote == altered * 16
    assert warm.usage.computed_tokens == warm.usage.prompt_tokens - altered * 16


def test_the_pages_a_first_step_filled_after_pages_read_in_place_are_cached_too(tiny):
    """The step that read pages in place also filled pages after them, which could not be indexed
    before their parent: they are indexed once the pages are copied in, so the same prompt again
    is a local hit on every full page."""
    tier = PoolTier()
    long_prompt = PROMPT * 2
    writer = Reader(tiny, tier)
    cold = writer.generate(long_prompt[:100], max_new_tokens=2)  # the node holds only the first pages
    reader = Reader(tiny, tier)
    warm = reader.generate(long_prompt, max_new_tokens=4, ignore_eos=True)
    assert 0 < warm.usage.cached_tokens_remote < warm.usage.prompt_tokens - 16
    again = reader.generate(long_prompt, max_new_tokens=1)
    assert again.usage.cached_tokens_local == (again.usage.prompt_tokens // 16) * 16
    assert tier.released == 1
    reader.engine.pool.check_invariants()


def test_a_model_with_a_sliding_window_copies_its_pages_in_at_the_join(tiny):
    """Its steps release the blocks behind the window, those of pages read in place among them, so
    its pages are copied in before its first step instead: the answer is a cold run's."""
    config = dataclasses.replace(tiny.config, sliding_window=40)
    windowed = Model("tiny-windowed", config, random_tensors(ARCH_MODULES[config.arch].tensor_shapes(config), config,
                                                             PRESET_SEEDS["tiny"]), tiny.tokenizer)
    tier = PoolTier()
    cold = Reader(windowed, tier).generate(PROMPT * 2, max_new_tokens=8, ignore_eos=True)
    reader = Reader(windowed, tier)
    warm = reader.generate(PROMPT * 2, max_new_tokens=8, ignore_eos=True)  # read in place, pages 9-10 went wrong
    assert warm.usage.cached_tokens_remote >= 10 * 16
    assert warm.token_ids == cold.token_ids
    assert tier.released == 1 and not reader.engine.scheduler.in_place.num_reading()


def test_the_window_of_a_node_whose_client_let_its_pool_go_is_unmapped():
    """A node that stopped (its client dropped the mapping) or a client closed: the sweep unmaps
    the window too, so the node's memory is freed as the client's own mapping would free it."""
    from types import SimpleNamespace

    from kvnode.client import SharedPoolFile
    from worker.kv.pages_in_place import InPlaceReader

    shape = (2, 2, 1, 16, 8)
    arena = BlockArena(3, shape, np.float32)
    fd = os.memfd_create("test-pool")
    try:
        os.ftruncate(fd, 4 * arena.block_bytes)
        client = SimpleNamespace(generation=5)
        client.shared_pool_file = lambda: (SharedPoolFile(os.dup(fd), 4, arena.block_bytes, client.generation)
                                           if client.generation else None)
        node = SimpleNamespace(address="127.0.0.1:1", client=client)
        reader = InPlaceReader(arena)
        assert reader.attach_now(node)
        window = reader._window(node)
        reader.sweep()
        assert reader._window(node) is window and not window.detached, "a live mapping keeps its window"
        client.generation = None  # the client let the pool go
        reader.sweep()
        assert window.detached and reader._windows == {}
        reader.close()
    finally:
        os.close(fd)


def test_a_node_met_while_a_pins_attach_runs_is_still_mapped_once_its_client_maps_the_pool():
    """First contact asks for the node's pool in the arena (prepare) while an attach that a pin
    began is still running, and that one finds the pool not mapped yet: the prepare is not lost,
    it runs once that attach ends and maps the pool when the client has (InPlaceReader.prepare)."""
    import threading
    from types import SimpleNamespace

    from kvnode.client import SharedPoolFile
    from worker.kv.pages_in_place import InPlaceReader

    shape = (2, 2, 1, 16, 8)
    arena = BlockArena(3, shape, np.float32)
    fd = os.memfd_create("test-pool")
    asked, go_on = threading.Event(), threading.Event()
    try:
        os.ftruncate(fd, 4 * arena.block_bytes)
        client = SimpleNamespace(mapped=False)

        def shared_pool_file():
            asked.set()
            go_on.wait(10)
            return SharedPoolFile(os.dup(fd), 4, arena.block_bytes, 7) if client.mapped else None

        def shared_pool_state(wait):
            client.mapped = True  # the client's own mapping, done
            return "mapped"

        client.shared_pool_file, client.shared_pool_state = shared_pool_file, shared_pool_state
        node = SimpleNamespace(address="127.0.0.1:1", client=client)
        reader = InPlaceReader(arena)
        assert reader._window(node) is None  # a pin finds no window: an attach begins
        assert asked.wait(10)
        reader.prepare(node)  # first contact, while that attach runs
        go_on.set()  # it finds the pool unmapped and ends; the prepare then runs
        deadline = time.monotonic() + 10
        while not reader.attached(node.address) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.attached(node.address), "the prepare asked for during another attach was lost"
        reader.close()
    finally:
        os.close(fd)


@pytest.mark.parametrize("states, mapped, asked", [
    (["mapping", "mapping", "mapped"], True, 3),  # waits out the client's mapping, slice by slice
    (["mapping", "unasked"], False, 2),  # a mapping that failed (asked again later)
    (["refused"], False, 1),  # never mapped: no wait
    ([None], False, 1),  # no data plane client
])
def test_the_arena_waits_for_the_mapping_its_nodes_client_says_is_under_way(states, mapped, asked):
    """prepare asks the node's client for its pool's state (NodeClient.shared_pool_state), waiting
    in slices while it says "mapping" (InPlaceReader._client_mapped)."""
    from types import SimpleNamespace

    from worker.kv.pages_in_place import _MAPPING_SLICE_S, InPlaceReader

    waits = []

    def shared_pool_state(wait):
        waits.append(wait)
        return states[min(len(waits), len(states)) - 1]

    client = SimpleNamespace(shared_pool_state=shared_pool_state, shared_pool_file=lambda: None)
    reader = InPlaceReader(BlockArena(3, (2, 2, 1, 16, 8), np.float32))
    try:
        assert reader._client_mapped(SimpleNamespace(address="127.0.0.1:1", client=client)) is mapped
        assert waits == [_MAPPING_SLICE_S] * asked
    finally:
        reader.close()


def test_close_ends_the_wait_for_a_nodes_client_still_mapping():
    import threading
    from types import SimpleNamespace

    from worker.kv.pages_in_place import _MAPPING_WAIT_S, InPlaceReader

    waiting = threading.Event()

    def shared_pool_state(wait):
        waiting.set()
        time.sleep(wait)
        return "mapping"

    client = SimpleNamespace(shared_pool_state=shared_pool_state, shared_pool_file=lambda: None)
    reader = InPlaceReader(BlockArena(3, (2, 2, 1, 16, 8), np.float32))
    reader.prepare(SimpleNamespace(address="127.0.0.1:1", client=client))
    assert waiting.wait(5)
    started = time.monotonic()
    reader.close()  # waits for the attaching thread
    assert time.monotonic() - started < _MAPPING_WAIT_S / 2
