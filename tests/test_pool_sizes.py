"""Pools sized to the model (base/pool_sizes.py): a worker's default KV pool holds one sequence of
its model's full context, a kvnode's (with --model) lets one lookup lease a whole prompt that long,
both within bounds; `cluster up` says both in one line, and each daemon says in its start line the
longest prompt its pool takes, and the flag that raises it when that is below the model's."""

from __future__ import annotations

import pytest

from base.pool_sizes import (MAX_NODE_POOL_BYTES, MAX_WORKER_POOL_BYTES, MIN_POOL_BYTES, leased_pages, node_pool,
                             worker_pool)
from cluster_helpers import node_process
from kvcache.launch import Daemon
from worker.model.named import DEFAULT_MODEL, named_model_installed

# smollm2-135m in float32: 16 tokens x 30 layers x (K, V) x 3 KV heads x 64 dims x 4 bytes.
SMOLLM2_PAGE = 16 * 30 * 2 * 3 * 64 * 4
SMOLLM2_POSITIONS = 8192
MiB = 1 << 20


def test_a_worker_holds_one_full_context_of_smollm2():
    pool = worker_pool(SMOLLM2_PAGE, SMOLLM2_POSITIONS, 16)
    assert (pool.pages, pool.bytes, pool.size(), pool.capped) == (512, 360 * MiB, "360MiB", False)


def test_a_kvnode_leases_a_whole_smollm2_context_at_half_its_pool():
    pool = node_pool(SMOLLM2_PAGE, SMOLLM2_POSITIONS, 16, 0.5)
    assert (pool.pages, pool.size(), leased_pages(pool.pages, 0.5)) == (1024, "720MiB", 512)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.33, 0.5, 0.6, 0.7, 0.9, 1.0])
def test_the_kvnode_leases_the_whole_context_at_any_fraction_the_cap_allows(fraction):
    pool = node_pool(SMOLLM2_PAGE, SMOLLM2_POSITIONS, 16, fraction)
    assert pool.capped or leased_pages(pool.pages, fraction) >= 512


def test_small_models_get_the_floor_and_long_contexts_the_cap():
    tiny_page = 4 * 2 * 4 * 16 * 64 * 4
    assert worker_pool(tiny_page, 1024, 16).bytes == MIN_POOL_BYTES  # 8 MiB would do: room for many requests
    long = worker_pool(SMOLLM2_PAGE, 131072, 16)
    assert long.capped and long.bytes <= MAX_WORKER_POOL_BYTES and long.pages == MAX_WORKER_POOL_BYTES // SMOLLM2_PAGE
    node = node_pool(SMOLLM2_PAGE, 131072, 16, 0.5)
    assert node.capped and node.bytes <= MAX_NODE_POOL_BYTES
    assert node_pool(SMOLLM2_PAGE, SMOLLM2_POSITIONS, 16, 0.0).capped  # no leases: no size makes one


def worker_line(tmp_path, *args: str) -> str:
    log = tmp_path / f"worker{len(list(tmp_path.iterdir()))}.log"
    with Daemon("worker", ["--port", "0", "--model", "tiny", *args], log_path=log) as worker:
        worker.stop(timeout_s=10.0)
    return next(line for line in log.read_text().splitlines() if "listening on" in line)


def test_a_worker_says_its_pool_holds_a_full_context_or_what_to_give_for_one(tmp_path):
    assert worker_line(tmp_path).endswith("512 blocks, 64.0 MiB: one full 1024-token context of the model)")
    assert worker_line(tmp_path, "--kv-cache", "4MiB").endswith(
        "32 blocks, 4.0 MiB: prompts up to 512 tokens, fewer than the model's 1024; --kv-cache 8MiB holds a "
        "full context)")


def node_line(tmp_path, *args: str) -> str:
    folder = tmp_path / f"node{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    with node_process(folder, *args) as node:
        node.stop(timeout_s=10.0)
    return next(line for line in (folder / "node.log").read_text().splitlines() if "listening on" in line)


def test_a_kvnode_given_the_model_leases_a_whole_prompt_and_says_so(tmp_path):
    line = node_line(tmp_path, "--model", "tiny")
    assert "(512 pages of 131072 bytes, 64.0 MiB, eviction prefix-lru; leases at most 256 pages at once, " \
           "--max-leased-fraction 0.5 of the pool: a whole 1024-token prompt of tiny)" in line
    assert node_line(tmp_path, "--page-bytes", "1024").endswith(
        "leases at most 131072 pages at once, --max-leased-fraction 0.5 of the pool)")  # 256MiB: no model, no tokens


@pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL), reason="the default model's package is not installed")
def test_a_kvnode_too_small_for_the_models_context_names_the_capacity_that_fits(tmp_path):
    line = node_line(tmp_path, "--model", DEFAULT_MODEL, "--capacity", "64MiB")
    assert line.endswith(f"leases at most 45 pages at once, --max-leased-fraction 0.5 of the pool: 720 tokens of a "
                         f"{DEFAULT_MODEL} prompt, fewer than its 8192; --capacity 720MiB leases a whole one)"), line
