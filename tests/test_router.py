"""Routing: least outstanding first, sticky to the warm worker while loads are close."""

from coordinator.router import Router

WORKERS = ["w1", "w2", "w3"]


def test_spreads_by_outstanding_requests():
    router = Router(close_load=0)
    picks = [router.choose(f"key{i}", WORKERS) for i in range(6)]
    assert sorted(picks) == ["w1", "w1", "w2", "w2", "w3", "w3"]
    router.done("w2")
    assert router.choose("fresh", WORKERS) == "w2"


def test_same_key_sticks_to_its_worker_while_loads_are_close():
    router = Router(close_load=2)
    first = router.choose("system-prompt", WORKERS)
    assert router.choose("system-prompt", WORKERS) == first  # 1 outstanding vs 0: close
    assert router.choose("system-prompt", WORKERS) == first  # 2 vs 0: still close
    assert router.choose("system-prompt", WORKERS) != first  # 3 vs 0: too far, go elsewhere


def test_excluded_and_missing_workers_are_skipped():
    router = Router()
    assert router.choose("k", WORKERS, exclude=["w1", "w2"]) == "w3"
    assert router.choose("k", []) is None
    assert router.choose("k", ["w1"], exclude=["w1"]) is None
    warm = router.choose("k2", ["w1", "w2"])
    assert router.choose("k2", [w for w in ["w1", "w2"] if w != warm]) != warm
