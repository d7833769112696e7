"""The engine on the real tiny model: equal to a full recompute, whatever the batching, chunking,
caching or preemption."""

import numpy as np
import pytest

from worker.engine import Engine


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


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_tiny_engine_prefix_cache_hit_gives_the_cold_tokens(tiny, kv_dtype):
    engine = Engine.load("tiny", kv_dtype=kv_dtype, num_blocks=32, page_tokens=16)
    system = "You are a helpful assistant. Answer briefly. "  # 45 bytes: two full pages
    engine.generate([system + "first question?"], max_new_tokens=3)
    warm = engine.generate([system + "second question?"], max_new_tokens=8, seed=3, temperature=0.8)[0]
    cold = Engine.load("tiny", kv_dtype=kv_dtype, num_blocks=32, page_tokens=16).generate(
        [system + "second question?"], max_new_tokens=8, seed=3, temperature=0.8)[0]
    assert warm.usage.cached_tokens_local == 32 and cold.usage.cached_tokens_local == 0
    assert warm.token_ids == cold.token_ids and warm.text == cold.text


def test_max_prefill_tokens_chunks_a_prompt_even_alone(tiny):
    """A 40-token prompt with 16-token chunks takes three steps; its tokens are those of one step."""
    prompt = list(range(1, 41))
    expected = tiny_engine(tiny, max_prefill_tokens=64).generate([prompt], max_new_tokens=3)[0].token_ids
    engine = tiny_engine(tiny, max_prefill_tokens=16)
    handle = engine.add_request(prompt, max_new_tokens=3)
    chunks = 0
    while handle.queue.empty():
        engine.step()
        chunks += 1
    assert chunks == 3
    while handle.completion is None:
        engine.step()
    assert handle.completion.token_ids == expected


def test_every_step_is_reported_with_its_requests_and_tokens(tiny):
    engine = tiny_engine(tiny, max_prefill_tokens=16)
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
