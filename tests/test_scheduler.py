"""The scheduler without a model: chunked prefill, preemption, admission from the prefix cache,
shortest-prefill-first order with aging."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.kv.block_pool import BlockPool
from worker.engine.sampling import SamplingParams
from worker.engine.request import Request, RequestStatus
from worker.engine.scheduler import Scheduler

P = 4
ROOT = bytes(16)


def make(pool_blocks=16, budget=64, max_seqs=8, **policy):
    pool = BlockPool(pool_blocks, (1, 2, 1, P, 2))
    return pool, Scheduler(pool, P, max_num_seqs=max_seqs, max_num_batched_tokens=budget, **policy)


def request(rid, n_prompt, max_new=4, first=0):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_new_tokens=max_new), ROOT, P)


def run_step(sched, pool, log=None, arriving=()):
    """One step as the engine does it, with a fake next token (the position, so it is checkable).
    `arriving` requests come while the step's forward runs: one may be computed between its layers."""
    batch = sched.schedule()
    pool.check_invariants()
    for req in arriving:
        sched.add(req)
    nested = sched.schedule_newcomer(batch) if arriving and batch.requests else None
    if nested is not None:
        assert len(nested) == 1 and nested.requests[0] not in batch.requests
        assert not written_blocks(batch) & set(nested.requests[0].block_table), "the step's pages are its own"
        assert not written_blocks(nested) & {b for r in batch.requests for b in r.block_table}
        account(sched, pool, nested)
    account(sched, pool, batch)
    if log is not None:
        log.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        if nested is not None:
            log.append(("between layers", nested.requests[0].request_id, nested.num_new_tokens[0]))
    return batch


def written_blocks(batch):
    """Blocks a batch's forward writes: those holding each request's new tokens."""
    return {req.block_table[page] for req, n in zip(batch.requests, batch.num_new_tokens)
            for page in range(req.num_computed_tokens // P, (req.num_computed_tokens + n - 1) // P + 1)}


def account(sched, pool, batch):
    for req, n in zip(batch.requests, batch.num_new_tokens):
        assert len(req.block_table) * P >= req.num_computed_tokens + n, "blocks cover the tokens computed"
        sched.on_computed(req, n)
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(1000 + req.num_tokens)
            if len(req.output_token_ids) >= req.params.max_new_tokens:
                sched.finish(req)
    pool.check_invariants()


def test_long_prompts_are_chunked_while_running_requests_keep_decoding():
    pool, sched = make(budget=8)
    sched.add(request("a", 3, max_new=10))
    run_step(sched, pool)
    sched.add(request("b", 20, max_new=2))
    log = []
    for _ in range(4):
        run_step(sched, pool, log)
    assert log == [[("a", 1), ("b", 7)], [("a", 1), ("b", 7)], [("a", 1), ("b", 6)], [("a", 1), ("b", 1)]]


def test_the_newest_request_is_preempted_keeps_its_tokens_and_finishes_later():
    pool, sched = make(pool_blocks=5, budget=64)
    a, b = request("a", 7, max_new=10), request("b", 7, max_new=10, first=100)
    sched.add(a)
    sched.add(b)
    steps = 0
    while sched.has_unfinished():
        run_step(sched, pool)
        steps += 1
        assert steps < 100
    assert sched.num_preemptions >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    for req in (a, b):
        assert req.status is RequestStatus.FINISHED
        first = req.token_ids[0]
        assert req.token_ids[:7] == list(range(first, first + 7))
        assert req.output_token_ids == [1000 + n for n in range(7, 17)], "no token lost or repeated"
    assert pool.get_num_free_blocks() == 5


def test_a_finished_prompt_is_reused_from_the_prefix_cache_in_whole_pages():
    pool, sched = make()
    first = request("a", 10, max_new=1)
    sched.add(first)
    run_step(sched, pool)
    assert first.status is RequestStatus.FINISHED and pool.get_num_cached_blocks() == 2
    again = request("b", 13, max_new=1)
    sched.add(again)
    batch = run_step(sched, pool)
    assert again.cached_tokens_local == 8 and batch.num_new_tokens == [5]
    exact = request("c", 8, max_new=1)  # exactly two cached pages: both reused, the last token computed
    sched.add(exact)
    batch = run_step(sched, pool)
    assert exact.cached_tokens_local == 7 and batch.num_new_tokens == [1]
    assert pool.get_num_cached_blocks() == 3   # nothing new: the last page was cached already


def test_bypass_cache_neither_reuses_nor_leaves_pages():
    pool, sched = make()
    sched.add(request("a", 10, max_new=1))
    run_step(sched, pool)
    cached = pool.get_num_cached_blocks()
    bypass = Request("b", list(range(13)), SamplingParams(max_new_tokens=1), ROOT, P, bypass_cache=True)
    sched.add(bypass)
    batch = run_step(sched, pool)
    assert bypass.cached_tokens_local == 0 and batch.num_new_tokens == [13]
    assert pool.get_num_cached_blocks() == cached


def test_finish_releases_blocks_at_once_even_while_waiting():
    pool, sched = make(pool_blocks=4, max_seqs=1)
    a, b = request("a", 5), request("b", 9)
    sched.add(a)
    sched.add(b)
    run_step(sched, pool)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    sched.finish(a)
    sched.finish(b)
    pool.check_invariants()
    assert not sched.has_unfinished() and pool.get_num_free_blocks() == 4 and not a.block_table


def test_a_request_larger_than_the_pool_is_refused():
    pool, sched = make(pool_blocks=2)
    with pytest.raises(ValueError, match="has 9 tokens; the pool holds at most 8"):
        sched.add(request("a", 9))


def test_options_are_checked():
    pool = BlockPool(4, (1, 2, 1, P, 2))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(pool, P, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Scheduler(pool, P, max_prefill_tokens=0)
    with pytest.raises(ValueError, match="alone_prefill_tokens"):
        Scheduler(pool, P, alone_prefill_tokens=0)
    with pytest.raises(ValueError, match="aging_steps"):
        Scheduler(pool, P, aging_steps=-1)
    with pytest.raises(ValueError, match="join_tokens"):
        Scheduler(pool, P, join_tokens=-1)


def test_a_mostly_cached_prompt_goes_before_a_long_uncached_one_that_came_first():
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=16)
    sched.add(request("warm", 21, max_new=1))
    while sched.has_unfinished():
        run_step(sched, pool)
    long, cached = request("long", 40, max_new=1, first=500), request("cached", 24, max_new=1)
    sched.add(long)
    sched.add(cached)
    log = []
    run_step(sched, pool, log)
    # 20 of cached's 24 tokens are in the prefix cache: 4 left, against 40 for the long one,
    # which waits for the next step rather than delaying cached's first token by its chunk.
    assert log == [[("cached", 4)]]
    assert cached.cached_tokens_local == 20 and cached.status is RequestStatus.FINISHED
    run_step(sched, pool, log)
    assert log[1] == [("long", 40)], "then the long prompt, whole: no decode waits on its step"


def test_a_short_prefill_goes_through_while_a_long_one_is_chunked():
    """The long prompt is chunked even alone (its alone chunk no larger), so a short one arriving
    meanwhile waits one chunk."""
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=12, alone_prefill_tokens=12)
    sched.add(request("long", 100, max_new=2, first=500))
    log = []
    run_step(sched, pool, log)
    sched.add(request("short", 5, max_new=2))
    for _ in range(3):
        run_step(sched, pool, log)
    assert log == [[("long", 12)], [("short", 5)], [("short", 1), ("long", 12)], [("long", 12)]]


def test_one_prefill_per_step_so_the_shortest_gets_its_first_token_first():
    """Three waiting prompts, the budget room for all: each step computes one of them, shortest
    first, with the decodes of those already through their prompt."""
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=32, join_tokens=2)
    for name, n, first in (("a", 12, 100), ("b", 3, 200), ("c", 7, 300)):
        sched.add(request(name, n, max_new=2, first=first))
    log = []
    for _ in range(4):
        run_step(sched, pool, log)
    assert log == [[("b", 3)], [("b", 1), ("c", 7)], [("c", 1), ("a", 12)], [("a", 1)]]


def test_prompts_that_finish_within_the_join_tokens_share_the_step():
    """After the shortest prompt, others join only if they finish within join_tokens more tokens
    in all; a longer one waits for a step of its own rather than delaying them."""
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=32, join_tokens=5)
    for name, n, first in (("long", 9, 100), ("a", 2, 200), ("b", 2, 300), ("c", 2, 400), ("d", 4, 500)):
        sched.add(request(name, n, max_new=1, first=first))
    log = []
    for _ in range(3):
        run_step(sched, pool, log)
    # a first; b and c join (2 + 2 of 5); d's 4 would pass the 5, long's 9 too.
    assert log == [[("a", 2), ("b", 2), ("c", 2)], [("d", 4)], [("long", 9)]]


def test_decodes_run_every_step_however_many_prefills_wait():
    pool, sched = make(pool_blocks=64, budget=16, max_prefill_tokens=8)
    decoding = request("decoding", 3, max_new=12)
    sched.add(decoding)
    run_step(sched, pool)
    for i in range(6):
        sched.add(request(f"p{i}", 10, max_new=1, first=100 * (i + 1)))
    for _ in range(10):
        batch = run_step(sched, pool)
        assert batch.requests[0] is decoding and batch.num_new_tokens[0] == 1
        assert sum(batch.num_new_tokens) <= 1 + 8, "prefill stays within its per-step budget"


@pytest.mark.parametrize("aging_steps", [0, 3, 10])
def test_aging_bounds_the_wait_of_a_long_prompt_under_a_stream_of_short_ones(aging_steps):
    """Three new short prompts every step fill the prefill budget, so shortest-first alone would
    never serve the long prompt; it must start once aged and then be computed at full budget."""
    budget, long_len = 8, 40
    pool, sched = make(pool_blocks=256, budget=64, max_seqs=64, max_prefill_tokens=budget, alone_prefill_tokens=budget,
                       aging_steps=aging_steps)
    long = request("long", long_len, max_new=1, first=10_000)
    sched.add(long)
    first_token_step = None
    for step in range(1, 40):
        for i in range(3):
            sched.add(request(f"s{step}.{i}", 3, max_new=1, first=100 * (3 * step + i)))
        batch = run_step(sched, pool)
        if step <= aging_steps:
            assert long not in batch.requests, "shorter prompts go first until the long one is aged"
        if long.output_token_ids and first_token_step is None:
            first_token_step = step
    # Aged from step aging_steps + 1 on, then long_len / budget steps at the full budget.
    assert first_token_step == aging_steps + -(-long_len // budget)


def test_a_newcomer_shorter_than_the_chunk_goes_between_its_layers_unless_it_would_preempt_or_it_is_aged():
    pool, sched = make(pool_blocks=64, budget=64, max_prefill_tokens=16, alone_prefill_tokens=16, join_tokens=4)
    sched.add(request("long", 60, max_new=1))
    log = []
    run_step(sched, pool, log, arriving=[request("short", 10, max_new=2, first=500)])
    run_step(sched, pool, log, arriving=[request("as long", 16, max_new=1, first=600)])
    assert log == [[("long", 16)], ("between layers", "short", 10), [("short", 1), ("long", 16)]]
    # Not when the pool could only take it by preempting a running request.
    pool, sched = make(pool_blocks=5, budget=64, max_prefill_tokens=16, alone_prefill_tokens=16, join_tokens=4)
    sched.add(request("long", 19, max_new=1))
    log = []
    run_step(sched, pool, log, arriving=[request("short", 6, max_new=1, first=500)])
    assert log == [[("long", 16)]] and sched.waiting[0].request_id == "short"
    # Nor in a step that found the pool short for a waiting prompt, though the newcomer would fit:
    # "w" (its first 12 tokens cached, idle) cannot be admitted beside "long"'s next chunk.
    pool, sched = make(pool_blocks=7, budget=64, max_prefill_tokens=12, alone_prefill_tokens=12, join_tokens=2)
    log = []
    sched.add(request("x", 12, max_new=1))
    run_step(sched, pool, log)
    sched.add(request("long", 24, max_new=1, first=1000))
    run_step(sched, pool, log)
    sched.add(request("w", 20, max_new=1))
    run_step(sched, pool, log, arriving=[request("short", 3, max_new=1, first=500)])
    assert log == [[("x", 12)], [("long", 12)], [("long", 12)]]
    assert [r.request_id for r in sched.waiting] == ["w", "short"]
    # Nor when the step's prompt was chosen for its age.
    pool, sched = make(pool_blocks=64, budget=64, max_prefill_tokens=16, alone_prefill_tokens=16, join_tokens=4,
                       aging_steps=0)
    sched.add(request("long", 60, max_new=1))
    sched.num_steps = 5
    log = []
    run_step(sched, pool, log, arriving=[request("short", 10, max_new=1, first=500)])
    assert log == [[("long", 16)]]


def test_aging_zero_serves_in_arrival_order():
    pool, sched = make(pool_blocks=64, budget=64, max_prefill_tokens=64, aging_steps=0, join_tokens=0)
    for name, n, first in (("a", 30, 100), ("b", 5, 200), ("c", 12, 300)):
        sched.add(request(name, n, max_new=1, first=first))
    log = []
    for _ in range(3):
        run_step(sched, pool, log)
    assert log == [[("a", 30)], [("b", 5)], [("c", 12)]]


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(3, 12), budget=st.integers(4, 24), max_seqs=st.integers(1, 4),
       prefill=st.integers(1, 24), alone=st.integers(1, 48), aging=st.integers(0, 6),
       requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 6), st.integers(0, 3), st.booleans(),
                                   st.booleans()),
                         min_size=1, max_size=6))
def test_every_request_finishes_with_its_tokens_whatever_the_pool_budget_and_arrivals(num_blocks, budget, max_seqs,
                                                                                        prefill, alone, aging, requests):
    """Random prompts (sharing prefixes), arrivals spread over steps, tiny pools: invariants hold every step,
    nothing deadlocks, and every request ends with exactly the tokens it would get alone."""
    pool, sched = make(pool_blocks=num_blocks, budget=max(budget, max_seqs), max_seqs=max_seqs,
                       max_prefill_tokens=prefill, alone_prefill_tokens=alone, aging_steps=aging)
    pending, created = [], []
    for i, (n_prompt, max_new, family, bypass, mid_step) in enumerate(requests):
        n_prompt = min(n_prompt, num_blocks * P - max_new)
        if n_prompt < 1:
            continue
        req = Request(f"r{i}", [family * 100 + t for t in range(n_prompt)], SamplingParams(max_new_tokens=max_new),
                      ROOT, P, bypass_cache=bypass)
        pending.append((i % 3, mid_step, req))
        created.append(req)
    steps = 0
    while pending or sched.has_unfinished():
        for _, mid_step, req in [p for p in pending if p[0] <= steps and not p[1]]:
            sched.add(req)
        arriving = [req for when, mid_step, req in pending if when <= steps and mid_step]
        pending = [p for p in pending if p[0] > steps]
        run_step(sched, pool, arriving=arriving)
        steps += 1
        assert steps < 500, "the scheduler stopped making progress"
    assert pool.get_num_free_blocks() == num_blocks
    for req in created:
        assert req.status is RequestStatus.FINISHED
        n = req.num_prompt_tokens
        assert req.output_token_ids == [1000 + k for k in range(n, n + req.params.max_new_tokens)]
