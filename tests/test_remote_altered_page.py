"""A page whose bytes were altered on a real kvnode (a bit flipped in its pool after the put, by
tests/fault_injection/sitecustomize.py) is refused by the real worker that fetches it, over the
data plane and over gRPC: the answer equals a cold run's, the pages before it come from the node,
it and the rest are computed, the worker counts one rejected page, and the node drops it with
its descendants, then stores the page computed in its place (good bytes again)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest

from cluster_helpers import collect, read_log, started, wait_for
from kvnode.client import NodeClient
from metrics_helpers import scrape
from test_node_disk_tier import flip_page_byte
from worker.client import WorkerClient
from worker.kv.pages import page_keys

FAULTS = Path(__file__).parent / "fault_injection"
PAGE_TOKENS = 16
PROMPT = "You are a careful assistant. Answer briefly and precisely, citing the page you used. Why?"
ALTERED = 2  # the third page of the prompt
_ATTEMPTS = itertools.count()  # prompts that let the reader meet a node's pool, each new


def altering_env(key: bytes) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["KVCACHE_TEST_ALTER_PAGE"] = key.hex()
    return env


@pytest.mark.parametrize("wire", ["data plane", "gRPC", "read in place"])
def test_a_page_altered_on_the_node_is_refused_and_the_answer_is_still_exact(tmp_path, wire):
    worker_args = ("--model", "tiny", "--kv-cache", "8MiB", "--grace", "5")
    with started(tmp_path, "worker", "writer", *worker_args) as writer, \
            started(tmp_path, "worker", "reader", *worker_args, "--metrics-port", "0") as reader:
        with WorkerClient(writer.address) as client_a, WorkerClient(reader.address) as client_b:
            root = bytes.fromhex(client_a.info().fingerprint)
            keys = page_keys(root, list(PROMPT.encode()), PAGE_TOKENS)  # the tiny model's tokens are bytes
            assert len(keys) == 5
            node_args = ["--model", "tiny", "--capacity", "16MiB"] + (["--no-data-plane"] if wire == "gRPC" else [])
            with started(tmp_path, "node", "node", *node_args, env=altering_env(keys[ALTERED])) as node, \
                    NodeClient(node.address) as node_client:
                collect(client_a.generate(PROMPT, max_tokens=4, placement=[node.address]))
                assert wait_for(lambda: node_client.lookup(keys) == len(keys), timeout_s=10.0)

                cold, _ = collect(client_b.generate(PROMPT, max_tokens=8, no_cache=True))
                if wire == "read in place":  # the reader maps the node's pool at its first fetch from it
                    assert wait_for(lambda: _reads_in_place(client_a, client_b, reader, node, node_client, root),
                                    timeout_s=30.0), "the reader never read pages in place"
                warm, done = collect(client_b.generate(PROMPT, max_tokens=8, placement=[node.address]))

                assert warm == cold and len(warm) == 8
                assert done.usage.cached_tokens_remote == ALTERED * PAGE_TOKENS
                assert done.usage.computed_tokens == done.usage.prompt_tokens - ALTERED * PAGE_TOKENS
                assert scrape(reader.metrics_url).value("kvcache_worker_remote_rejected_pages_total") == 1
                assert wait_for(lambda: node_client.stats()["reported_pages_dropped"] == len(keys) - ALTERED,
                                timeout_s=10.0)
                dropped = f"dropped page {keys[ALTERED].hex()} and {len(keys) - ALTERED - 1} descendants"
                assert dropped in read_log(tmp_path), read_log(tmp_path)
                # The reader wrote back what it computed in their place, after the drop: intact again.
                assert wait_for(lambda: node_client.lookup(keys) == len(keys), timeout_s=10.0)
                assert node_client.get_pages(keys).shape == (len(keys), node_client.info().page_bytes)  # checked
    for name in ("writer", "reader", "node"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()


def _reads_in_place(writer, reader_client, reader, node, node_client, root) -> bool:
    """One more prompt written to the node by the writer and fetched by the reader: whether the
    reader read its pages in place (it maps the node's pool into its arena after a first fetch)."""
    prompt = f"Prompt {next(_ATTEMPTS)} of those that let the reader meet the node's pool before the test."
    collect(writer.generate(prompt, max_tokens=1, placement=[node.address]))
    keys = page_keys(root, list(prompt.encode()), PAGE_TOKENS)
    assert wait_for(lambda: node_client.lookup(keys) == len(keys), timeout_s=10.0)
    collect(reader_client.generate(prompt, max_tokens=1, placement=[node.address]))
    return scrape(reader.metrics_url).value("kvcache_worker_remote_in_place_pages_total") > 0


def test_a_page_altered_in_a_kvnodes_slot_file_is_refused_by_the_worker_and_dropped_by_the_node(tmp_path):
    """The disk tier checks each slot whole once per process (kvnode/disk/tier.py): a byte flipped
    in the slot file while the node runs, in a page on disk only, goes out with its writer's
    checksum; the real worker refuses it, its answer stays exact, and its report drops the page
    and its descendants on the node."""
    worker_args = ("--model", "tiny", "--kv-cache", "8MiB", "--grace", "5")
    data_dir = tmp_path / "data"
    with started(tmp_path, "worker", "writer", *worker_args) as writer, \
            started(tmp_path, "worker", "reader", *worker_args, "--metrics-port", "0") as reader:
        with WorkerClient(writer.address) as client_a, WorkerClient(reader.address) as client_b:
            root = bytes.fromhex(client_a.info().fingerprint)
            keys = page_keys(root, list(PROMPT.encode()), PAGE_TOKENS)
            node_args = ["--model", "tiny", "--capacity", "256KiB", "--disk-capacity", "16MiB",  # RAM: 2 pages
                         "--data-dir", str(data_dir), "--flush-interval", "0.2"]
            with started(tmp_path, "node", "node", *node_args) as node, NodeClient(node.address) as node_client:
                collect(client_a.generate(PROMPT, max_tokens=4, placement=[node.address]))
                assert wait_for(lambda: node_client.lookup(keys) == len(keys), timeout_s=10.0)
                assert wait_for(lambda: node_client.info().dirty_pages == 0, timeout_s=10.0)
                flip_page_byte(data_dir, keys[ALTERED], node_client.info().page_bytes)

                cold, _ = collect(client_b.generate(PROMPT, max_tokens=8, no_cache=True))
                warm, done = collect(client_b.generate(PROMPT, max_tokens=8, placement=[node.address]))

                assert warm == cold and len(warm) == 8
                assert done.usage.cached_tokens_remote == ALTERED * PAGE_TOKENS
                assert scrape(reader.metrics_url).value("kvcache_worker_remote_rejected_pages_total") == 1
                assert wait_for(lambda: node_client.stats()["reported_pages_dropped"] == len(keys) - ALTERED,
                                timeout_s=10.0)
                assert node_client.stats()["corrupted_pages_dropped"] == 0, "the node served it: checked at start"
                assert f"dropped page {keys[ALTERED].hex()}" in read_log(tmp_path)
                assert wait_for(lambda: node_client.lookup(keys) == len(keys), timeout_s=10.0)
                assert node_client.get_pages(keys).shape == (len(keys), node_client.info().page_bytes)  # checked
    for name in ("writer", "reader", "node"):
        assert "Traceback" not in (tmp_path / f"{name}.log").read_text()
