"""The vLLM connector's two sides against a real kvnode process, as vLLM drives them: engine A
computes a prompt and saves its blocks; engine B is told how many tokens past its own hit the
cluster holds (polling while it answers None), allocates, loads them into other blocks of its
own, and gets A's bytes. Only full blocks are matched, never the one of the prompt's last token;
another cache_salt finds nothing; blocks found in the cluster are not saved again.
Each test uses prompts of its own, so they share one node."""

from __future__ import annotations


import numpy as np
import pytest

from cluster_helpers import node_process
from kvnode.client import NodeClient
from vllm_connector.keys import block_keys, block_pages, last_layer_keys
from vllm_connector_helpers import (no_errors_logged,  # noqa: F401 - autouse
                                     BLOCK_SIZE, LAYOUT, NODE_ARGS, NUM_LAYERS, PAGE_BYTES, blocks, engine,
                                    random_layers, settings, tokens)

FP = LAYOUT.fingerprint()


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with node_process(tmp_path_factory.mktemp("vllm-node"), *NODE_ARGS) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def writer(node):
    """Engine A: random KV in its blocks, saving to the node."""
    with engine(settings(node.address), random_layers(seed=100)) as a:
        yield a


@pytest.fixture
def reader(node):
    """Engine B: zeroed blocks, a new engine for each test (nothing known of the node yet)."""
    with engine(settings(node.address)) as b:
        yield b


def test_blocks_saved_by_one_engine_are_found_and_loaded_byte_for_byte_by_another(node, writer, reader):
    prompt = tokens(5 * BLOCK_SIZE + 3, seed=10)
    assert writer.matched("w1", prompt) == (0, False)  # nothing in the cluster yet
    a_ids = [7, 3, 9, 1, 12, 5]
    saved = writer.worker.counters.blocks_saved
    plan = writer.save("w1", prompt, a_ids)
    assert [(s.first, len(s.block_keys), s.block_ids, s.addresses) for s in plan.saves] == \
        [(0, 5, (7, 3, 9, 1, 12), (node.address,))]  # full blocks only: the 3 tokens of block 5 are not
    assert writer.worker.counters.blocks_saved == saved + 5 and writer.worker.counters.blocks_unsaved == 0

    keys = block_keys(FP, "", prompt, BLOCK_SIZE, 5)
    with NodeClient(node.address) as client:  # every page of the chain is on the node, with A's bytes
        pages = [k for b in range(5) for k in block_pages(keys[b], keys[b - 1] if b else None, NUM_LAYERS)[0]]
        assert client.lookup(pages) == 5 * NUM_LAYERS
        got = client.get_pages(pages).reshape(5, NUM_LAYERS, PAGE_BYTES).transpose(1, 0, 2)
        np.testing.assert_array_equal(got, blocks(writer.layers, a_ids[:5]))

    b_ids = [2, 4, 6, 8, 10, 11]
    num, errors, _ = reader.load("r1", prompt, b_ids)
    assert num == 5 * BLOCK_SIZE and errors == set()
    np.testing.assert_array_equal(blocks(reader.layers, b_ids[:5]), blocks(writer.layers, a_ids[:5]))
    untouched = [i for i in range(len(reader.layers[0])) if i not in b_ids[:5]]
    assert not blocks(reader.layers, untouched).any(), "a load wrote outside its blocks"
    assert (reader.worker.counters.blocks_loaded, reader.worker.counters.blocks_failed) == (5, 0)
    assert reader.worker.take_finished_loads() == (set(), set())  # each reported once


def test_only_the_blocks_past_vllms_own_hit_are_loaded_into_their_own_blocks(writer, reader):
    prompt = tokens(6 * BLOCK_SIZE + 1, seed=11)
    a_ids = [0, 2, 4, 6, 8, 10]
    writer.save("w2", prompt, a_ids + [11])
    b_ids = [13, 14, 15, 16, 17, 18, 19]
    num, errors, _ = reader.load("r2", prompt, b_ids, local=2 * BLOCK_SIZE)  # vLLM holds blocks 0 and 1 itself
    assert (num, errors) == (4 * BLOCK_SIZE, set())
    np.testing.assert_array_equal(blocks(reader.layers, b_ids[2:6]), blocks(writer.layers, a_ids[2:6]))
    assert not blocks(reader.layers, b_ids[:2] + b_ids[6:]).any()
    # vLLM's hit covers all that the cluster holds: nothing to load, answered without waiting.
    assert reader.matched("r3", prompt, local=6 * BLOCK_SIZE) == (0, False)


@pytest.mark.parametrize("length, matched", [(48, 2), (49, 3), (63, 3), (64, 3), (65, 4), (79, 4)])
def test_only_full_blocks_match_and_never_the_block_of_the_prompts_last_token(writer, reader, length, matched):
    """The node holds the first 4 blocks; a prompt of exactly k blocks matches k - 1 of them (vLLM
    computes the last prompt token itself), a partial block never."""
    base = tokens(5 * BLOCK_SIZE, seed=length)
    writer.save(f"w-full{length}", base[:4 * BLOCK_SIZE], [1, 2, 3, 4])
    num, errors, _ = reader.load(f"r-full{length}", base[:length], list(range(5, 10)))
    assert (num, errors) == (matched * BLOCK_SIZE, set())
    assert reader.worker.counters.blocks_loaded == matched
    np.testing.assert_array_equal(blocks(reader.layers, range(5, 5 + matched)),
                                  blocks(writer.layers, range(1, 1 + matched)))
    assert not blocks(reader.layers, range(5 + matched, 10)).any()


def test_another_tenants_cache_salt_finds_nothing_of_the_same_tokens(writer, reader):
    prompt = tokens(3 * BLOCK_SIZE + 5, seed=20)
    writer.save("w-tenant", prompt, [20, 21, 22, 23], salt="tenant-a")
    assert reader.matched("other", prompt, salt="tenant-b") == (0, False)
    assert reader.matched("shared", prompt, salt="") == (0, False)
    num, errors, _ = reader.load("same", prompt, [0, 1, 2, 3], salt="tenant-a")
    assert (num, errors) == (3 * BLOCK_SIZE, set())
    np.testing.assert_array_equal(blocks(reader.layers, [0, 1, 2]), blocks(writer.layers, [20, 21, 22]))


def test_blocks_found_in_the_cluster_are_not_saved_again_only_the_new_ones(node, writer, reader):
    prompt = tokens(2 * BLOCK_SIZE + 1, seed=21)
    writer.save("w-held", prompt, [14, 15, 16])
    longer = prompt[:2 * BLOCK_SIZE] + tokens(2 * BLOCK_SIZE + 1, seed=22)  # shares the first 2 blocks
    b_ids = [3, 5, 7, 9, 11]
    num, errors, _ = reader.load("r-held", longer, b_ids)
    assert (num, errors) == (2 * BLOCK_SIZE, set())
    # vLLM starts it once its blocks arrived: the 2 loaded blocks are computed already.
    reader.scheduler.start("r-held", longer, "", b_ids, 2 * BLOCK_SIZE)
    plan = reader.scheduler.plan({"r-held": len(longer)})
    assert [(s.first, len(s.block_keys), s.block_ids) for s in plan.saves] == [(2, 4, (7, 9))]
    reader.worker.save(plan.saves)
    assert reader.worker.wait_for_saves(10.0)
    assert (reader.worker.counters.blocks_saved, reader.worker.counters.blocks_unsaved) == (2, 0)
    with NodeClient(node.address) as client:  # the whole chain is there, the new blocks hold B's bytes
        keys = block_keys(FP, "", longer, BLOCK_SIZE, 4)
        assert client.lookup(last_layer_keys(keys, NUM_LAYERS)) == 4
        new_pages = [k for b in (2, 3) for k in block_pages(keys[b], keys[b - 1], NUM_LAYERS)[0]]
        got = client.get_pages(new_pages).reshape(2, NUM_LAYERS, PAGE_BYTES).transpose(1, 0, 2)
        np.testing.assert_array_equal(got, blocks(reader.layers, [7, 9]))


def test_blocks_the_cluster_holds_are_not_sent_again_when_vllm_recomputes_them(node, writer, reader):
    """The plan names every block vLLM computed (a load that failed partway leaves blocks the cluster
    lacks), and the saver asks the node first: only the block it lacks crosses the wire."""
    prompt = tokens(2 * BLOCK_SIZE + 1, seed=24)
    writer.save("w-recomputed", prompt, [14, 15, 16])
    longer = prompt[:2 * BLOCK_SIZE] + tokens(BLOCK_SIZE + 1, seed=25)
    assert reader.matched("r-recomputed", longer) == (2 * BLOCK_SIZE, True)
    reader.scheduler.after_alloc("r-recomputed", [0, 1, 2, 3], 0)  # vLLM computes them itself after all
    reader.scheduler.start("r-recomputed", longer, "", [0, 1, 2, 3], 0)
    plan = reader.scheduler.plan({"r-recomputed": len(longer)})
    assert [(s.first, s.block_ids) for s in plan.saves] == [(0, (0, 1, 2))]
    with NodeClient(node.address) as client:
        used = client.info().used_pages
        reader.worker.save(plan.saves)
        assert reader.worker.wait_for_saves(10.0)
        assert client.info().used_pages == used + NUM_LAYERS  # block 2 alone
        keys = block_keys(FP, "", longer, BLOCK_SIZE, 3)
        assert client.lookup(last_layer_keys(keys, NUM_LAYERS)) == 3
        got = client.get_pages(block_pages(keys[2], keys[1], NUM_LAYERS)[0]).reshape(1, NUM_LAYERS, PAGE_BYTES)
        np.testing.assert_array_equal(got.transpose(1, 0, 2), blocks(reader.layers, [2]))


def test_a_save_whose_earlier_blocks_the_node_lacks_sends_nothing(node, writer):
    """Blocks 0 and 1 were vLLM's own hit, never saved to this node: blocks 2 and 3 would be refused
    there (no parent), and the save holds no bytes for the ones before them."""
    prompt = tokens(4 * BLOCK_SIZE + 1, seed=26)
    unsaved = writer.worker.counters.blocks_unsaved
    writer.save("w-orphans", prompt, [1, 2, 3, 4, 5], computed=2 * BLOCK_SIZE)
    assert writer.worker.counters.blocks_unsaved == unsaved + 2
    with NodeClient(node.address) as client:
        keys = block_keys(FP, "", prompt, BLOCK_SIZE, 4)
        pages = [k for b in range(4) for k in block_pages(keys[b], keys[b - 1] if b else None, NUM_LAYERS)[0]]
        assert client.lookup(pages[:1]) == 0 and client.lookup(pages[2 * NUM_LAYERS:][:1]) == 0


def test_a_prompt_the_cluster_holds_part_of_is_matched_as_far_as_it_goes(writer, reader):
    prompt = tokens(6 * BLOCK_SIZE + 2, seed=23)
    writer.save("w-part", prompt[:2 * BLOCK_SIZE + 7], [17, 18, 19])  # 2 full blocks of it
    num, errors, _ = reader.load("r-part", prompt, list(range(7)))
    assert (num, errors) == (2 * BLOCK_SIZE, set())
    np.testing.assert_array_equal(blocks(reader.layers, [0, 1]), blocks(writer.layers, [17, 18]))
