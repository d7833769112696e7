"""Pages a sliding window has left behind (worker/kv/window.py): a running sequence releases them, holds
a bounded number of blocks however long it grows, and computes exactly what it computes holding
them all; released pages stay cached until evicted, and evicting one drops the cached pages below it."""

import math

import numpy as np
import pytest

from worker.kv.block_pool import BlockPool
from worker.engine.engine import Engine
from worker.model import ForwardBatch
from worker.model.dense import reference_logits
from worker.model.testing import llama_config, random_model
from worker.kv.window import RELEASED, first_read_block, release_window

W, P = 8, 2
HELD_BOUND = math.ceil(W / P) + 1
PROMPT = [int(t) for t in np.random.default_rng(3).integers(0, 256, 20)]


@pytest.fixture(scope="module")
def mistral():
    return random_model(llama_config(sliding_window=W), seed=5)


def engine_for(model, release=True, **options):
    engine = Engine(model, page_tokens=P, max_prefill_tokens=6, alone_prefill_tokens=6,
                    **dict(dict(num_blocks=64), **options))
    if not release:
        engine.scheduler.release_window = None  # the same engine holding every page to the end
    return engine


def test_only_windows_on_every_layer_release_pages():
    assert release_window([8, 8]) == 8
    assert release_window([4, 8]) == 8, "the widest window decides: a page holds every layer"
    assert release_window([8, None, 8]) is None, "a full-attention layer reads every page"
    assert release_window([]) is None
    assert [first_read_block(n, 8, 2) for n in (0, 7, 8, 9, 10, 20)] == [0, 0, 0, 1, 1, 6]
    assert first_read_block(100, None, 2) == 0


def test_released_entries_are_never_read(mistral):
    """The same decode step over a table whose passed entries are RELEASED and over one holding
    them gives bit-identical logits, equal to a recomputation under the window."""
    ids = PROMPT + [7, 9, 11, 13]
    c = mistral.config
    pool = np.zeros((32, c.n_layers, 2, c.n_kv_heads, P, c.head_dim), np.float32)
    table = np.arange(1, 13, dtype=np.int32)
    batch = ForwardBatch(np.array(ids[:-1]), np.arange(len(ids) - 1), np.array([0, len(ids) - 1]),
                         np.array([len(ids) - 1]), [table])
    mistral.forward(batch, pool)
    n = len(ids)
    released = table.copy()
    released[: first_read_block(n - 1, W, P)] = RELEASED
    assert (released == RELEASED).sum() == 8

    def decode(t):
        return mistral.forward(ForwardBatch(np.array(ids[-1:]), np.array([n - 1]), np.array([0, 1]),
                                            np.array([n]), [t]), pool.copy())

    held, without = decode(table), decode(released)
    assert np.array_equal(held, without)
    np.testing.assert_allclose(without[0], reference_logits(mistral, ids)[-1], atol=1e-4, rtol=0)
    full = random_model(llama_config(), seed=5)  # no window: every entry is read, a RELEASED one refused
    with pytest.raises(ValueError, match="block table needs 12 ids"):
        full.forward(ForwardBatch(np.array(ids[-1:]), np.array([n - 1]), np.array([0, 1]), np.array([n]),
                                  [released]), pool.copy())


def run_steps(engine, prompts, max_new_tokens=90):
    """Step the engine to the end; after each step: invariants, and the most blocks any request held."""
    handles = [engine.add_request(p, max_new_tokens=max_new_tokens, ignore_eos=True) for p in prompts]
    most_held, least_free = 0, engine.pool.num_blocks
    while engine.has_unfinished():
        engine.step()
        engine.pool.check_invariants()
        for r in engine.scheduler.running:
            most_held = max(most_held, len(r.held_blocks()))
            assert all(b == RELEASED for b in r.block_table[: r.num_released_blocks])
        least_free = min(least_free, engine.get_num_free_blocks())
    return [h.completion for h in handles], most_held, least_free


def test_a_long_generation_holds_a_bounded_window_and_computes_the_same(mistral):
    (kept,), kept_held, kept_free = run_steps(engine_for(mistral, release=False), [PROMPT])
    engine = engine_for(mistral)
    (done,), held, least_free = run_steps(engine, [PROMPT])
    assert len(done.token_ids) == 90 and done.token_ids == kept.token_ids
    assert held <= HELD_BOUND and kept_held >= 100 // P
    assert least_free >= 64 - HELD_BOUND, "released pages count as available at once"
    assert kept_free == 64 - kept_held
    # 109 tokens computed (the last one sampled is not): every full page stays in the prefix cache
    assert engine.pool.get_num_cached_blocks() == 109 // P
    ids = PROMPT + done.token_ids[:10]
    expected = [int(np.argmax(row)) for row in reference_logits(mistral, ids)[len(PROMPT) - 1:-1]]
    assert done.token_ids[:10] == expected


def test_uncached_pages_go_back_to_the_free_list(mistral):
    engine = engine_for(mistral)
    handle = engine.add_request(PROMPT, max_new_tokens=60, ignore_eos=True, bypass_cache=True)
    free_lists = []
    while engine.has_unfinished():
        engine.step()
        free_lists.append(len(engine.pool.free_block_ids))
    assert len(handle.completion.token_ids) == 60
    assert min(free_lists) >= 64 - HELD_BOUND and engine.pool.get_num_cached_blocks() == 0


def test_two_sequences_outgrow_a_small_pool_without_preemption(mistral):
    """16 blocks of 2 tokens, two sequences of 30 tokens: held whole they preempt each other;
    releasing, they run together, evicting each other's released pages (and what lies below them)."""
    other = [int(t) for t in np.random.default_rng(4).integers(0, 256, 20)]
    alone = [run_steps(engine_for(mistral), [p], 10)[0][0].token_ids for p in (PROMPT, other)]
    engine = engine_for(mistral, num_blocks=16)
    done, held, _ = run_steps(engine, [PROMPT, other], 10)
    assert [c.token_ids for c in done] == alone
    assert engine.scheduler.num_preemptions == 0 and engine.pool.num_evictions > 0 and held <= HELD_BOUND
    cramped = engine_for(mistral, release=False, num_blocks=16)
    assert [c.token_ids for c in run_steps(cramped, [PROMPT, other], 10)[0]] == alone
    assert cramped.scheduler.num_preemptions > 0


SHAPE = (1, 2, 1, P, 2)


def key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


def test_evicting_a_released_page_drops_the_cached_pages_below_it():
    pool = BlockPool(5, SHAPE)
    a, b, c = pool.allocate(3)
    for block, name, parent in ((a, "a", None), (b, "b", "a"), (c, "c", "b")):
        pool.cache_full_block(block, key(name), parent and key(parent))
    pool.release([a])  # the window passed page a; the sequence still holds b and c
    pool.ref([a, b])  # another sequence shares a and b, adds its own page e, and finishes
    (e,) = pool.allocate(1)
    pool.cache_full_block(e, key("e"), key("b"))
    pool.release([a, b, e])
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 3, "a free block and the idle pages a and e"
    (d,) = pool.allocate(1)
    assert d not in (a, b, c, e)
    assert pool.allocate(1) == [a], "the released page, least recently used, is reclaimable"
    pool.check_invariants()
    assert pool.get_num_cached_blocks() == 0 and pool.lookup([key("a"), key("b")]) == []
    assert pool.free_block_ids == [e], "the idle page below it went free"
    assert pool.cache_full_block(d, key("d"), key("c")) == d and pool.lookup([key("d")]) == [], (
        "a page whose parent was dropped is not indexed")
    pool.release([b, c, d])
    pool.check_invariants()
    assert sorted(pool.free_block_ids) == sorted([b, c, d, e])
