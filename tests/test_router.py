"""Routing: least outstanding first, sticky to the warm worker while loads are close; a request that
bypasses the cache neither follows nor sets that preference."""

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


def test_a_request_that_bypasses_the_cache_leaves_no_preference_behind():
    """An uncached request warms no worker: the next cached request of its key goes to the least
    loaded worker, not to where the uncached one ran (which piled a family's first cached requests
    onto one worker after a burst of uncached ones)."""
    router = Router(close_load=2)
    uncached = router.choose("system-prompt", WORKERS, cached=False)
    assert uncached == "w1"  # the least loaded (ties: the first)
    router.choose("other", WORKERS)  # w2
    router.done("w1")
    router.done("w2")
    assert router.choose("busy", ["w1"]) == "w1"  # w1 now carries one
    assert router.choose("system-prompt", WORKERS) == "w2", "followed the uncached request's worker"


def test_an_uncached_request_ignores_the_warm_worker_and_counts_where_it_went():
    router = Router(close_load=2)
    warm = router.choose("system-prompt", WORKERS)
    router.done(warm)
    router.choose("filler", [warm])  # the warm worker carries one now, the others none
    uncached = router.choose("system-prompt", WORKERS, cached=False)
    assert uncached != warm
    assert router.outstanding(uncached) == 1
    assert router.choose("system-prompt", WORKERS) == warm, "the cached preference was changed by an uncached request"
