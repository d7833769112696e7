"""The ring's measured properties: balance, minimal movement on joins and leaves, weights, agreement."""

from collections import Counter

import pytest

from coordinator.ring import Ring, epoch_of, placement_key

GIB = 2**30
KEYS = [placement_key(f"prompt number {i}") for i in range(100_000)]


def shares(ring: Ring) -> Counter:
    return Counter(ring.primary(k) for k in KEYS)


@pytest.mark.parametrize("num_nodes, address", [(3, "10.0.0.{}:7000"), (5, "10.0.0.{}:7000"), (10, "10.0.0.{}:7000"),
                                                 (7, "127.0.0.1:4{:04d}"), (10, "127.0.0.1:5{:04d}")])
def test_most_loaded_node_within_115_percent_of_mean(num_nodes, address):
    ring = Ring({address.format(i): GIB for i in range(num_nodes)})
    counts = shares(ring)
    assert len(counts) == num_nodes
    mean = len(KEYS) / num_nodes
    assert max(counts.values()) <= 1.15 * mean, counts


@pytest.mark.parametrize("num_nodes", [3, 6, 9])
def test_adding_a_node_moves_about_one_share(num_nodes):
    nodes = {f"node-{i}:7000": GIB for i in range(num_nodes)}
    before = Ring(nodes)
    after = Ring({**nodes, "newcomer:7000": GIB})
    moved = [k for k in KEYS if before.primary(k) != after.primary(k)]
    assert all(after.primary(k) == "newcomer:7000" for k in moved)  # only to the new node
    assert len(moved) / len(KEYS) <= 1.2 / (num_nodes + 1)


def test_removing_a_node_moves_only_its_keys():
    nodes = {f"node-{i}:7000": GIB for i in range(6)}
    before = Ring(nodes)
    gone = "node-2:7000"
    after = Ring({a: c for a, c in nodes.items() if a != gone})
    for key in KEYS[:20_000]:
        if before.primary(key) != gone:
            assert after.primary(key) == before.primary(key)
        else:
            assert after.primary(key) != gone


def test_weights_shift_shares_in_proportion():
    ring = Ring({"small:1": GIB, "medium:1": 2 * GIB, "large:1": 4 * GIB})
    counts = shares(ring)
    total = len(KEYS)
    for address, weight in (("small:1", 1), ("medium:1", 2), ("large:1", 4)):
        expected = weight / 7
        assert abs(counts[address] / total - expected) <= 0.15 * expected, counts


def test_placement_gives_distinct_replicas_and_caps_at_live_count():
    ring = Ring({f"n{i}:1": GIB for i in range(4)})
    for key in KEYS[:1000]:
        nodes = ring.placement(key, 3)
        assert len(nodes) == 3 == len(set(nodes))
        assert nodes[0] == ring.primary(key)
    assert len(ring.placement(KEYS[0], 10)) == 4
    assert Ring({}).placement(KEYS[0], 2) == []


def test_same_view_same_epoch_and_placement_regardless_of_order():
    a = Ring({"x:1": GIB, "y:1": GIB, "z:1": 2 * GIB})
    b = Ring({"z:1": 2 * GIB, "x:1": GIB, "y:1": GIB})
    assert a.epoch == b.epoch == epoch_of({"y:1": GIB, "z:1": 2 * GIB, "x:1": GIB})
    assert all(a.placement(k, 2) == b.placement(k, 2) for k in KEYS[:2000])
    assert Ring({"x:1": GIB}).epoch != a.epoch


def test_placement_key_uses_session_or_prompt_prefix():
    system = "You are a helpful assistant. " * 4
    assert placement_key(system + "What is 2+2?") == placement_key(system + "Name a colour.")
    assert placement_key("short one") != placement_key("short two")
    assert placement_key("anything", session_id="s1") == placement_key("else", session_id="s1")


def test_placement_walks_the_ring_as_uhashring_range_does():
    ring = Ring({f"127.0.0.1:{7000 + i}": (i % 3 + 1) * 2**30 for i in range(12)})
    for i in range(2000):
        key = placement_key(f"prompt {i}")
        for replicas in (1, 2, 3, 12, 20):
            expected = [c["nodename"] for c in ring._ring.range(key, size=min(replicas, 12))]
            assert ring.placement(key, replicas) == expected
