"""The engine on the real tiny model: equal to a full recompute, whatever the batching, chunking,
caching or preemption."""

import numpy as np
import pytest

from worker.engine.engine import Engine


@pytest.fixture(scope="module")
def tiny():
    from worker.model import load_model

    return load_model("tiny")


def tiny_engine(model, **options):
    options = {"num_blocks": 64, "page_tokens": 16, "max_num_batched_tokens": 256, "seed": 0, **options}
    return Engine(model, **options)


TINY_PROMPTS = ["The cache remembers what the model computed. ", "x", "Paged attention reads keys and values " * 2]


def test_tiny_engine_tokens_equal_a_full_recompute_without_cache(tiny):
    from worker.model.dense import reference_logits

    out = tiny_engine(tiny).generate([TINY_PROMPTS[0]], max_new_tokens=6)[0]
    ids = list(out.prompt_token_ids)
    for _ in range(6):
        ids.append(int(np.argmax(reference_logits(tiny, ids)[-1])))
    assert out.token_ids == ids[len(out.prompt_token_ids):]


def test_tiny_engine_batched_chunked_cached_and_preempted_runs_agree(tiny):
    params = dict(max_new_tokens=10)
    expected = [tiny_engine(tiny).generate([p], **params)[0].token_ids for p in TINY_PROMPTS]
    together = tiny_engine(tiny, max_num_batched_tokens=16, max_num_seqs=4).generate(TINY_PROMPTS, **params)
    assert [o.token_ids for o in together] == expected
    cramped = tiny_engine(tiny, num_blocks=6)  # the longest request alone takes all 6 blocks: preemption is certain
    outs = cramped.generate(TINY_PROMPTS * 2, **params)
    assert cramped.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected * 2
    cramped.pool.check_invariants()


def test_a_float16_pool_gives_the_tokens_of_a_float32_pool_holding_float16_kv(tiny):
    """The pool in the KV dtype changes no answer: the same rounded values, read back exactly."""
    half = tiny_engine(tiny, kv_dtype="float16", max_num_batched_tokens=16, max_num_seqs=4)
    single = tiny_engine(tiny, kv_dtype="float16", max_num_batched_tokens=16, max_num_seqs=4)
    single.pool.kv = single.pool.kv.astype(np.float32)   # float16 KV rounded into a float32 pool, as before
    assert half.kv_pool.dtype == np.float16 and single.kv_pool.dtype == np.float32
    params = dict(max_new_tokens=12, seed=3, temperature=0.8)   # sampled: any logit that differed could show
    outs = [engine.generate(TINY_PROMPTS, **params) for engine in (half, single)]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    used = [b for b in range(64) if single.kv_pool[b].any()]
    assert used and np.array_equal(half.kv_pool[used].astype(np.float32).view(np.uint32),
                                   single.kv_pool[used].view(np.uint32))


def test_the_same_kv_cache_bytes_hold_twice_the_blocks_in_float16(tiny):
    budget = 8 * 2**20
    single, half = (Engine(tiny, kv_dtype=d, kv_cache_bytes=budget) for d in ("float32", "float16"))
    assert half.pool.num_blocks == 2 * single.pool.num_blocks
    assert half.kv_pool.nbytes == single.kv_pool.nbytes <= budget
    assert half.get_num_free_blocks() == half.pool.num_blocks


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8", "int4"])
def test_tiny_engine_prefix_cache_hit_gives_the_cold_tokens(tiny, kv_dtype):
    engine = Engine.load("tiny", kv_dtype=kv_dtype, num_blocks=32, page_tokens=16)
    system = "You are a helpful assistant. Answer briefly. "  # 45 bytes: two full pages
    engine.generate([system + "first question?"], max_new_tokens=3)
    warm = engine.generate([system + "second question?"], max_new_tokens=8, seed=3, temperature=0.8)[0]
    cold = Engine.load("tiny", kv_dtype=kv_dtype, num_blocks=32, page_tokens=16).generate(
        [system + "second question?"], max_new_tokens=8, seed=3, temperature=0.8)[0]
    assert warm.usage.cached_tokens_local == 32 and cold.usage.cached_tokens_local == 0
    assert warm.token_ids == cold.token_ids and warm.text == cold.text


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8", "int4"])
def test_a_prompt_whose_every_page_is_cached_computes_its_last_token_alone(tiny, kv_dtype):
    """64 bytes: four full pages. Asked again, every page is reused and only the last token is
    computed (its K/V read from the cached page, which is left as it was), for the cold tokens."""
    prompt = "A page-aligned prompt: sixty-four bytes, four pages of sixteen. "
    assert len(prompt.encode()) == 64
    engine = tiny_engine(tiny, kv_dtype=kv_dtype)
    first = engine.generate([prompt], max_new_tokens=6)[0]
    from worker.kv.pages import page_keys

    blocks = engine.pool.lookup(page_keys(engine.fingerprint, list(first.prompt_token_ids), 16))
    assert len(blocks) == 4
    cached = engine.kv_pool[blocks].copy()
    forwards = []
    engine.on_step = forwards.append
    warm = engine.generate([prompt], max_new_tokens=6)[0]
    assert warm.token_ids == first.token_ids == tiny_engine(tiny, kv_dtype=kv_dtype).generate(
        [prompt], max_new_tokens=6)[0].token_ids
    assert (warm.usage.cached_tokens_local, warm.usage.computed_tokens) == (63, 1)
    assert forwards[0]["requests"][0]["new"] == 1       # the first step computed one token, not a page
    np.testing.assert_array_equal(engine.kv_pool[blocks], cached)   # the cached pages were not written
    engine.pool.check_invariants()


def test_a_prompt_alone_is_computed_in_chunks_of_alone_prefill_tokens(tiny):
    """A 40-token prompt alone: one step by default, three with 16-token chunks alone; its tokens
    are the same either way."""
    prompt = list(range(1, 41))
    answers = []
    for options, num_chunks in (({}, 1), ({"alone_prefill_tokens": 16}, 3)):
        engine = tiny_engine(tiny, max_prefill_tokens=8, **options)
        handle = engine.add_request(prompt, max_new_tokens=3)
        chunks = 0
        while handle.queue.empty():
            engine.step()
            chunks += 1
        assert chunks == num_chunks
        while handle.completion is None:
            engine.step()
        answers.append(handle.completion.token_ids)
    assert answers[0] == answers[1]


def test_beside_a_decode_a_prompt_is_computed_in_chunks_of_max_prefill_tokens(tiny):
    engine = tiny_engine(tiny, max_prefill_tokens=16)
    records = []
    engine.on_step = records.append
    decoding = engine.add_request([5, 6, 7], max_new_tokens=3, ignore_eos=True, request_id="d")
    engine.step()
    engine.add_request(list(range(1, 61)), max_new_tokens=1, request_id="p")
    while engine.has_unfinished():
        engine.step()
    # Two chunks beside "d"'s last two tokens, then the rest alone, in one chunk.
    assert [[(q["id"], q["new"]) for q in r["requests"]] for r in records] == [
        [("d", 3)], [("d", 1), ("p", 16)], [("d", 1), ("p", 16)], [("p", 28)]]
    assert decoding.completion.usage.completion_tokens == 3


def test_every_step_is_reported_with_its_requests_and_tokens(tiny):
    engine = tiny_engine(tiny, max_prefill_tokens=16, alone_prefill_tokens=16)
    records = []
    engine.on_step = records.append
    out = engine.generate([list(range(1, 41))], max_new_tokens=3, request_id="r")[0]
    assert len(records) == 3 + 2  # three prefill chunks (16, 16, 8), then two decodes
    assert [[(q["id"], q["new"], q["computed"], q["prompt"]) for q in r["requests"]] for r in records] == [
        [("r", 16, 0, 40)], [("r", 16, 16, 40)], [("r", 8, 32, 40)], [("r", 1, 40, 40)], [("r", 1, 41, 40)]]
    assert all(r["forward_ms"] > 0 and r["schedule_ms"] >= 0 for r in records)
    assert records[0]["time"] <= records[-1]["time"] and out.usage.completion_tokens == 3
    arrived = {q["arrived"] for r in records for q in r["requests"]}
    assert len(arrived) == 1 and arrived.pop() <= records[0]["time"]


def test_a_newcomer_computed_between_the_layers_of_a_chunk_gets_its_own_tokens(tiny, monkeypatch):
    """Real layers: the chunk is half-way through when the newcomer (reusing a cached prefix, in a
    pool small enough that its admission evicts idle pages) runs its whole forward."""
    shared = list(range(1, 49))
    long_prompt, newcomer = list(range(100, 180)), shared + [7, 8, 9, 10, 11]
    alone = {name: tiny_engine(tiny).generate([p], max_new_tokens=4)[0].token_ids
             for name, p in (("long", long_prompt), ("newcomer", newcomer))}
    engine = tiny_engine(tiny, num_blocks=10, max_prefill_tokens=32, alone_prefill_tokens=32)
    engine.generate([list(range(200, 250))], max_new_tokens=2)  # 3 idle cached pages, the oldest
    engine.generate([shared + [1, 2]], max_new_tokens=2)  # 3 more: the newcomer's prefix
    long = engine.add_request(long_prompt, max_new_tokens=4)
    engine.step()
    evictions = engine.pool.num_evictions
    added, layers = [], []
    forward = tiny.forward

    def forward_with_arrival(batch, kv_pool, kv_dtype="float32", between_layers=None):
        if added:  # the newcomer's own forward, run from a pause
            return forward(batch, kv_pool, kv_dtype, between_layers=between_layers)
        added.append(engine.add_request(newcomer, max_new_tokens=4))

        def pause():
            layers.append(len(layers))
            between_layers()

        return forward(batch, kv_pool, kv_dtype, between_layers=pause)

    monkeypatch.setattr(tiny, "forward", forward_with_arrival)
    deltas = engine.step()
    monkeypatch.setattr(tiny, "forward", forward)
    assert [d.request_id for d in deltas] == [added[0].request_id], "its first token came out of this step"
    assert len(layers) == tiny.config.n_layers - 1
    assert engine.pool.num_evictions > evictions, "the step and its newcomer took idle pages"
    while engine.has_unfinished():
        engine.step()
    assert added[0].completion.usage.cached_tokens_local == 48
    assert long.completion.token_ids == alone["long"] and added[0].completion.token_ids == alone["newcomer"]
    engine.pool.check_invariants()
