"""A real `kvcache node --data-dir` process: pages survive SIGKILL and SIGTERM, a flipped or
cut page is dropped with its descendants at restart and the rest served, a chain longer than
RAM is served whole, Info and Stats count per tier, and bad options get one clear line."""

from __future__ import annotations

import os
import re
import signal

import grpc
import numpy as np
import pytest

from cluster_helpers import node_process, read_log, run_kvcache, wait_for
from kvnode.client import NodeClient, NodeError, PageRejected
from kvnode.disk.tier import BLOCK_BYTES, DISK_CHECKS, HEADER, HEADER_BYTES, MAGIC, SLOTS_FILE, DiskTier
from kvnode.disk.data_dir import NODE_ID_FILE
from store_helpers import key
from test_disk_tier import flip_byte
from test_node_daemon import assert_one_clear_error

PAGE_BYTES = 1024
CHAINS, LENGTH = 30, 100  # 3,000 pages: 12x what RAM holds
RAM = ("--capacity", "256KiB", "--page-bytes", str(PAGE_BYTES))


def disk_args(data_dir, *more: str) -> tuple[str, ...]:
    return (*RAM, "--data-dir", str(data_dir), "--disk-capacity", "4MiB", *more)


def chains(first: int = 0, count: int = CHAINS) -> list[tuple[list[bytes], np.ndarray]]:
    out = []
    for c in range(first, first + count):
        keys = [key(c * 1000 + i) for i in range(LENGTH)]
        data = np.random.default_rng(c).integers(0, 256, size=(LENGTH, PAGE_BYTES), dtype=np.uint8)
        out.append((keys, data))
    return out


def put_chains(client: NodeClient, all_chains) -> None:
    for keys, data in all_chains:
        for first in range(0, LENGTH, 50):
            parents = [keys[first - 1] if first else b""] + keys[first : first + 49]
            assert client.put_pages(keys[first : first + 50], parents, data[first : first + 50]).stored == 50


def served(client: NodeClient, keys: list[bytes], data: np.ndarray) -> int:
    """Pages of the chain the node finds; asserts their bytes are the ones put."""
    hits = client.lookup(keys)
    if hits:
        got = np.concatenate([client.get_pages(keys[i : min(i + 50, hits)]) for i in range(0, hits, 50)])
        np.testing.assert_array_equal(got, data[:hits])
    return hits


def test_pages_on_disk_before_a_sigkill_are_all_served_again_with_identical_bytes(tmp_path):
    data_dir = tmp_path / "data"
    acknowledged, late = chains(), chains(first=CHAINS, count=3)
    with node_process(tmp_path, *disk_args(data_dir, "--flush-interval", "0.2")) as daemon:
        with NodeClient(daemon.address) as client:
            put_chains(client, acknowledged)
            assert wait_for(lambda: client.info().dirty_pages == 0, timeout_s=20), "not flushed in time"
            put_chains(client, late)  # acknowledged in RAM; maybe on disk by the kill, maybe not
            node_id = client.info().node_id
        daemon.kill()
    assert (data_dir / NODE_ID_FILE).read_text().strip() == node_id
    with node_process(tmp_path, *disk_args(data_dir)) as daemon, NodeClient(daemon.address) as client:
        info = client.info()
        assert info.node_id == node_id, "the node id is kept in --data-dir"
        assert sum(served(client, keys, data) for keys, data in acknowledged) == CHAINS * LENGTH
        for keys, data in late:
            served(client, keys, data)  # whatever made it is a prefix of the chain, with its bytes
        stats = client.stats()
        assert stats["recovered_pages"] >= CHAINS * LENGTH and stats["promotions"] > 0
        assert stats["corrupted_pages_dropped"] == 0 and stats["disk_errors"] == 0
    assert re.search(r"recovered \d+ pages from .* in [\d.]+s; dropped 0 corrupted", read_log(tmp_path))


def test_a_flipped_page_and_a_cut_file_lose_those_pages_and_their_descendants_only(tmp_path):
    data_dir = tmp_path / "data"
    all_chains = chains(count=4)
    with node_process(tmp_path, *disk_args(data_dir, "--flush-interval", "60")) as daemon:
        with NodeClient(daemon.address) as client:
            put_chains(client, all_chains)
        assert daemon.stop() == 0  # SIGTERM writes the pages still in RAM
    assert "wrote 256 pages to the disk tier; it holds 400 pages" in read_log(tmp_path)  # 144 went on demotion
    tier = DiskTier(data_dir, 4 * 1024 * 1024 // PAGE_BYTES, PAGE_BYTES)
    slots = {}
    head, scratch = bytearray(HEADER_BYTES), bytearray(PAGE_BYTES)
    for slot in range(tier.capacity_pages):
        header = tier.inspect(slot, head, scratch)
        if header is not None:
            slots[header.key] = slot
    tier.close()
    (keys0, data0), (keys1, data1), (keys2, data2), (keys3, data3) = all_chains
    flip_byte(data_dir / SLOTS_FILE, slots[keys1[40]] * tier.slot_bytes + HEADER_BYTES + 7)
    last = max(slots.values())
    lost_by_cut = next(k for k, s in slots.items() if s == last)
    os.truncate(data_dir / SLOTS_FILE, last * tier.slot_bytes + HEADER_BYTES + 10)
    cut_chain = next(i for i, (keys, _) in enumerate(all_chains) if lost_by_cut in keys)
    assert cut_chain != 1
    with node_process(tmp_path, *disk_args(data_dir)) as daemon, NodeClient(daemon.address) as client:
        hits = [served(client, keys, data) for keys, data in all_chains]
        expected = [LENGTH] * 4
        expected[1] = 40
        expected[cut_chain] = all_chains[cut_chain][0].index(lost_by_cut)
        assert hits == expected
        stats = client.stats()
        assert stats["corrupted_pages_dropped"] == 2
        assert stats["orphaned_pages_dropped"] == (LENGTH - 41) + (LENGTH - 1 - expected[cut_chain])
    assert "dropped 2 corrupted or torn pages" in read_log(tmp_path)


def flip_page_byte(data_dir, page_key: bytes, page_bytes: int = PAGE_BYTES) -> None:
    """Flip a byte of `page_key`'s page in the slot file, found by its header (the node may run)."""
    slot_bytes = -(-(HEADER_BYTES + page_bytes) // BLOCK_BYTES) * BLOCK_BYTES
    with open(data_dir / SLOTS_FILE, "rb") as f:
        for slot in range(os.path.getsize(data_dir / SLOTS_FILE) // slot_bytes):
            f.seek(slot * slot_bytes)
            head = f.read(HEADER_BYTES)
            if head[:4] == MAGIC and HEADER.unpack_from(head)[6] == page_key:
                break
        else:
            raise AssertionError(f"no slot holds page {page_key.hex()}")
    flip_byte(data_dir / SLOTS_FILE, slot * slot_bytes + HEADER_BYTES + 7)


@pytest.mark.parametrize("check", DISK_CHECKS)
def test_a_page_altered_on_disk_while_the_node_runs_is_never_used_and_is_dropped_with_its_descendants(tmp_path,
                                                                                                    check):
    """The disk check (kvnode/disk/tier.py). Checked at start (the default), the node serves the altered
    page's bytes with its writer's checksum: NodeClient refuses it (PageRejected), and the report
    (DropPages) drops it and its descendants. With --disk-check always the node refuses it itself.
    Either way a page altered on disk is found again at the next start."""
    data_dir = tmp_path / "data"
    (keys0, data0), (keys1, data1), *_ = all_chains = chains(count=4)  # 0 and most of 1 on disk only
    args = disk_args(data_dir, "--flush-interval", "0.2", *(["--disk-check", check] if check != "start" else []))
    with node_process(tmp_path, *args) as daemon:
        with NodeClient(daemon.address) as client:
            put_chains(client, all_chains)
            assert wait_for(lambda: client.info().dirty_pages == 0, timeout_s=20), "not flushed in time"
            flip_page_byte(data_dir, keys0[40])
            flip_page_byte(data_dir, keys1[10])  # not read before the restart
            if check == "start":
                with pytest.raises(PageRejected) as rejected:
                    client.get_pages(keys0[:50])
                assert (rejected.value.index, rejected.value.key) == (40, keys0[40])
                assert client.drop_pages([keys0[40]]) == LENGTH - 40
            else:
                with pytest.raises(NodeError) as refused:
                    client.get_pages(keys0[:50])
                assert refused.value.code == grpc.StatusCode.NOT_FOUND and not isinstance(refused.value, PageRejected)
            assert client.lookup(keys0) == 40 and served(client, keys0, data0) == 40
            stats = client.stats()
            assert (stats["reported_pages_dropped"], stats["corrupted_pages_dropped"],
                    stats["orphaned_pages_dropped"]) == ((LENGTH - 40, 0, 0) if check == "start" else (0, 1, LENGTH - 41))
        assert daemon.stop() == 0
    log_text = read_log(tmp_path)
    assert f"disk check {check}" in log_text
    assert f"dropped page {keys0[40].hex()}" in log_text or f"page {keys0[40].hex()} failed its check" in log_text
    assert "Traceback" not in log_text
    with node_process(tmp_path, *disk_args(data_dir)) as daemon, NodeClient(daemon.address) as client:
        assert client.lookup(keys1) == 10 and served(client, keys1, data1) == 10
        stats = client.stats()
        assert (stats["corrupted_pages_dropped"], stats["orphaned_pages_dropped"]) == (1, LENGTH - 11)
        assert client.lookup(keys0) == 40


def test_data_dir_alone_keeps_the_ram_tier_across_a_clean_restart_and_counts_per_tier(tmp_path):
    data_dir = tmp_path / "data"
    [(keys, data)] = chains(count=1)
    args = (*RAM, "--data-dir", str(data_dir), "--flush-interval", "60")
    with node_process(tmp_path, *args) as daemon, NodeClient(daemon.address) as client:
        put_chains(client, [(keys, data)])
        info = client.info()
        assert (info.capacity_pages, info.ram_capacity_pages, info.disk_capacity_pages) == (256, 256, 256)
        assert (info.used_pages, info.ram_used_pages, info.dirty_pages, info.disk_used_pages) == (100, 100, 100, 0)
        os.kill(daemon.pid, signal.SIGTERM)
        daemon.process.wait(timeout=20)
    with node_process(tmp_path, *args) as daemon, NodeClient(daemon.address) as client:
        info = client.info()
        assert (info.used_pages, info.ram_used_pages, info.disk_used_pages) == (100, 0, 100)
        assert served(client, keys, data) == LENGTH
        assert client.info().ram_used_pages == LENGTH
        assert client.stats()["recovered_pages"] == LENGTH


def test_a_chain_longer_than_ram_is_served_whole_by_a_real_node(tmp_path):
    [(keys, data)] = chains(count=1)
    long_keys = [key(5000 + i) for i in range(600)]  # 600 pages, RAM holds 256
    long_data = np.random.default_rng(9).integers(0, 256, size=(600, PAGE_BYTES), dtype=np.uint8)
    with node_process(tmp_path, *disk_args(tmp_path / "data")) as daemon, NodeClient(daemon.address) as client:
        for first in range(0, 600, 50):
            parents = [long_keys[first - 1] if first else b""] + long_keys[first : first + 49]
            assert client.put_pages(long_keys[first : first + 50], parents, long_data[first : first + 50]).stored == 50
        assert client.lookup(long_keys[:256]) == 256 and client.lookup(long_keys[256:512]) == 256
        assert client.lookup(long_keys[512:]) == 600 - 512
        got = np.concatenate([client.get_pages(long_keys[i : i + 50]) for i in range(0, 600, 50)])
        np.testing.assert_array_equal(got, long_data)
        info = client.info()
        assert info.ram_used_pages == 256 and info.used_pages == 600


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--disk-capacity", "1MiB"], ["--disk-capacity needs --data-dir"]),
        (["--data-dir", "{tmp}/d", "--disk-capacity", "100KiB"], ["fewer than --capacity's 256"]),
        (["--data-dir", "{tmp}/d", "--flush-interval", "-1"], ["--flush-interval must be a finite number"]),
        (["--data-dir", "{tmp}/d", "--flush-interval", "nan"], ["--flush-interval must be a finite number", "nan"]),
        (["--data-dir", "{tmp}/d", "--flush-interval", "inf"], ["--flush-interval must be a finite number", "inf"]),
    ],
)
def test_bad_disk_options_exit_with_one_clear_error_line(tmp_path, args, fragments):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert_one_clear_error(run_kvcache(["node", "--port", "0", *RAM, *args]), *fragments)


def test_a_data_dir_in_use_or_of_another_page_size_is_refused(tmp_path):
    data_dir = tmp_path / "data"
    with node_process(tmp_path, *RAM, "--data-dir", str(data_dir)):
        result = run_kvcache(["node", "--port", "0", *RAM, "--data-dir", str(data_dir)])
        assert_one_clear_error(result, "is in use by another node")
    result = run_kvcache(["node", "--port", "0", "--capacity", "256KiB", "--page-bytes", "2048",
                          "--data-dir", str(data_dir)])
    assert_one_clear_error(result, "holds pages of 1024 bytes", "this node stores pages of 2048")
