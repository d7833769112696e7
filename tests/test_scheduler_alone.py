"""The scheduler's chunk for a prompt in a step with no decode (alone_prefill_tokens), and where
the pool lacks room for it; the rest of the scheduler's rules are tests/test_scheduler.py's."""

from worker.connector.loads import FinishedLoads
from worker.engine.sampling import SamplingParams
from worker.engine.request import Request, RequestStatus
from test_scheduler import P, ROOT, make, request, run_step


def test_a_prompt_alone_in_its_step_is_computed_in_chunks_of_alone_prefill_tokens():
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=8, alone_prefill_tokens=24)
    sched.add(request("long", 60, max_new=1))
    log = []
    for _ in range(3):
        run_step(sched, pool, log)
    assert log == [[("long", 24)], [("long", 24)], [("long", 12)]]
    # Never a smaller chunk alone than beside decodes.
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=16, alone_prefill_tokens=4)
    sched.add(request("long", 40, max_new=1))
    assert run_step(sched, pool).num_new_tokens == [16]


def test_beside_a_decode_a_prompt_is_computed_in_chunks_of_max_prefill_tokens():
    pool, sched = make(pool_blocks=32, budget=64, max_prefill_tokens=8, alone_prefill_tokens=24)
    sched.add(request("decoding", 3, max_new=3))
    log = []
    run_step(sched, pool, log)
    sched.add(request("long", 60, max_new=1, first=100))
    for _ in range(4):
        run_step(sched, pool, log)
    # Once "decoding" finished (its third token), the prompt's steps are alone.
    assert log == [[("decoding", 3)], [("decoding", 1), ("long", 8)], [("decoding", 1), ("long", 8)],
                   [("long", 24)], [("long", 20)]]


def test_a_prompt_alone_takes_the_smaller_chunk_where_the_pool_lacks_room_for_the_larger():
    """Neither preempting nor holding admission for a chunk that is only faster: the high-priority
    prompt starts in chunks of max_prefill_tokens beside the one whose blocks fill the pool."""
    pool, sched = make(pool_blocks=12, budget=64, max_prefill_tokens=4, alone_prefill_tokens=48)
    sched.add(request("decoding", 3, max_new=4))
    log = []
    run_step(sched, pool, log)
    low = Request("low", list(range(100, 140)), SamplingParams(max_new_tokens=1), ROOT, P, priority=1)
    sched.add(low)
    for _ in range(3):
        run_step(sched, pool, log)
    sched.add(Request("high", list(range(300, 340)), SamplingParams(max_new_tokens=1), ROOT, P, priority=0))
    for _ in range(3):
        run_step(sched, pool, log)
    assert log[4:] == [[("high", 4)]] * 3, "admitted, then grown, in the chunk the pool has room for"
    assert sched.num_preemptions == 0 and low.status is RequestStatus.RUNNING and low.num_computed_tokens == 12


class AnsweringTier:
    """A connector whose lookups answer at once, `found` pages for each request, and whose loads
    never land (the requests stay parked, holding their blocks); those in `early` may join a step
    before (RemoteJoins.join_early)."""

    def __init__(self, found, early=()):
        self.found, self.early, self.loaded = found, early, {}
        self.lookups = self.layerwise_loads = self

    def take(self, request):
        return self.found[request.request_id]

    peek = take

    def start_load(self, request, keys, block_ids):
        self.loaded[request.request_id] = len(block_ids)

    def take_finished_loads(self):
        return FinishedLoads()

    def in_flight(self, request):
        return False

    def can_join_early(self, request):
        return request.request_id in self.early

    def start(self, request, keys):
        pass

    def join_early(self, request):
        pass

    def write_back(self, request, keys, local_blocks, start):
        pass

    def on_page_full(self, key, parent_key, block_id, context):
        pass


def test_a_prompt_alone_takes_the_smaller_chunk_rather_than_fewer_remote_pages():
    """"r"'s 6 remote pages and a 16-token chunk after them would need 10 blocks, 8 are left beside
    the parked "q": it takes the 4-token chunk and all 6 pages, not 4 pages and the larger chunk."""
    tier = AnsweringTier({"q": 2, "r": 6})
    pool, sched = make(pool_blocks=10, budget=64, max_prefill_tokens=4, alone_prefill_tokens=16, connector=tier)
    sched.add(request("q", 8, first=100))
    sched.add(request("r", 40, first=200))
    assert sched.schedule().requests == []
    assert tier.loaded == {"q": 2, "r": 6} and [r.request_id for r in sched.parked] == ["q", "r"]


def test_an_early_join_alone_takes_the_alone_chunk_where_the_pool_has_room():
    for pool_blocks, chunk in ((16, 16), (10, 4)):  # 10: 2 blocks beside "q" and "r"'s 6 remote pages
        tier = AnsweringTier({"q": 2, "r": 6}, early={"r"})
        pool, sched = make(pool_blocks=pool_blocks, budget=64, max_prefill_tokens=4, alone_prefill_tokens=16,
                           connector=tier)
        sched.add(request("q", 8, first=100))
        sched.add(request("r", 40, first=200))
        sched.schedule()
        batch = sched.schedule()
        assert batch.layerwise and [r.request_id for r in batch.requests] == ["r"] and batch.num_new_tokens == [chunk]
