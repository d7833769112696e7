"""The engine end to end over the toy model of engine_helpers, whose every output depends on the
whole cached context: batching, chunking, prefix cache, preemption, sampling, stops, the remote
tier. (With other threads at work: test_engine_threads.py.)"""

from dataclasses import replace

import numpy as np
import pytest

from engine_helpers import PROMPTS, P, ToyModel, alone, make_engine
from worker.connector.connector import Tier
from worker.engine.engine import Engine
from worker.kv.pages import page_keys


def test_prompts_generated_together_give_the_tokens_each_gives_alone_even_chunked():
    expected = [alone(p, max_new_tokens=12).token_ids for p in PROMPTS]
    assert len({tuple(t) for t in expected}) == len(PROMPTS)
    for budget in (256, 8):
        engine = make_engine(budget=budget)
        outs = engine.generate(PROMPTS, max_new_tokens=12)
        assert [o.token_ids for o in outs] == expected
        assert all(o.finish_reason == "length" and o.usage.completion_tokens == 12 for o in outs)
        if budget == 8:
            assert max(len(b.token_ids) for b in engine.model.forward_calls) <= 8, "prefills were chunked"
        engine.pool.check_invariants()
        assert engine.get_num_free_blocks() == engine.pool.num_blocks


def test_requests_joining_mid_run_get_the_tokens_they_get_alone():
    expected = [alone(p, max_new_tokens=10).token_ids for p in PROMPTS]
    engine = make_engine(budget=16)
    handles = [engine.add_request(PROMPTS[0], max_new_tokens=10)]
    for prompt in PROMPTS[1:]:
        for _ in range(3):
            engine.step()
        handles.append(engine.add_request(prompt, max_new_tokens=10))
    while engine.has_unfinished():
        engine.step()
    assert [h.completion.token_ids for h in handles] == expected


def test_a_prefix_cache_hit_gives_the_tokens_of_a_cold_run_and_usage_shows_it():
    engine = make_engine()
    first = engine.generate(["x" * 30], max_new_tokens=4)[0]
    assert first.usage.cached_tokens_local == 0 and first.usage.computed_tokens == 30
    longer = "x" * 30 + "yz" * 10
    warm = engine.generate([longer], max_new_tokens=12)[0]
    cold = alone(longer, max_new_tokens=12)
    assert warm.token_ids == cold.token_ids
    full_x_pages = 30 // P  # the first request's later pages hold its generated tokens: no match
    assert warm.usage.cached_tokens_local == full_x_pages * P
    assert warm.usage.computed_tokens == 50 - full_x_pages * P and warm.usage.prompt_tokens == 50
    same = engine.generate([longer], max_new_tokens=12)[0]
    assert same.token_ids == cold.token_ids and same.usage.cached_tokens_local == (50 - 1) // P * P


def test_float16_kv_cache_hit_matches_cold():
    engine = make_engine(kv_dtype="float16")
    engine.generate(["q" * 20], max_new_tokens=2)
    warm = engine.generate(["q" * 20 + "rst"], max_new_tokens=10)[0]
    cold = make_engine(kv_dtype="float16").generate(["q" * 20 + "rst"], max_new_tokens=10)[0]
    assert warm.usage.cached_tokens_local == 16 and warm.token_ids == cold.token_ids


def test_preempted_requests_give_the_tokens_they_would_give_unpreempted():
    prompts = ["m" * 20, "n" * 12 + "op", "q" * 17, "r" * 9]
    params = dict(max_new_tokens=20)
    expected = [alone(p, **params).token_ids for p in prompts]
    engine = make_engine(num_blocks=9, budget=64)  # 72 token slots; the four need up to ~150
    outs = engine.generate(prompts, **params)
    assert engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in outs) == engine.scheduler.num_preemptions
    assert [o.token_ids for o in outs] == expected
    engine.pool.check_invariants()


def test_seeded_sampling_reproduces_and_does_not_depend_on_batch_mates():
    params = dict(max_new_tokens=15, temperature=1.0, top_k=20, top_p=0.95)
    solo = alone("sample me", seed=42, **params)
    batch = make_engine(budget=8).generate(["other prompt", "sample me", "more"], seed=42, **params)
    mixed = make_engine().generate(["sample me", "zzz"], params=None, seed=42, **params)
    assert batch[1].token_ids == solo.token_ids == mixed[0].token_ids
    assert alone("sample me", seed=43, **params).token_ids != solo.token_ids
    greedy = alone("sample me", max_new_tokens=15)
    assert greedy.token_ids != solo.token_ids


def test_stop_strings_and_stop_tokens():
    cold = alone("stop here", max_new_tokens=20)
    stop = cold.text[5:7]
    cut = cold.text.index(stop)
    stopped = alone("stop here", max_new_tokens=20, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == cold.text[:cut]
    assert stopped.token_ids == cold.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) == cut + len(stop)
    token = cold.token_ids[6]
    by_token = alone("stop here", max_new_tokens=20, stop_token_ids=[token])
    first = cold.token_ids.index(token)
    assert by_token.finish_reason == "stop" and by_token.token_ids == cold.token_ids[:first + 1]
    assert by_token.text == cold.text[:first]


def test_generation_stops_at_any_of_the_models_end_of_text_ids():
    """A model whose metadata lists further end-of-text ids (Llama 3's end of turn, GGUF's
    eot_token_id) stops at each of them as at its eos; ignore_eos goes past them all."""
    cold = alone("stop here", max_new_tokens=20)
    token = cold.token_ids[6]
    first = cold.token_ids.index(token)
    model = ToyModel()
    model.config = replace(model.config, extra_eos_token_ids=(255, token))
    engine = Engine(model, num_blocks=64, page_tokens=P, seed=0)
    [stopped] = engine.generate(["stop here"], max_new_tokens=20)
    assert stopped.finish_reason == "stop" and stopped.token_ids == cold.token_ids[:first + 1]
    assert stopped.text == cold.text[:first], "an end-of-text id is not text"
    [past] = engine.generate(["stop here"], max_new_tokens=20, ignore_eos=True)
    assert past.token_ids == cold.token_ids and past.finish_reason == "length"


def test_streaming_yields_the_completion_piece_by_piece():
    engine = make_engine()
    deltas = list(engine.stream("stream this", max_new_tokens=9, stop=["zz"]))
    final = deltas[-1].completion
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert sum((d.token_ids for d in deltas), []) == final.token_ids
    assert "".join(d.text for d in deltas) == final.text == alone("stream this", max_new_tokens=9, stop=["zz"]).text
    assert final.usage.ttft_ms is not None and final.usage.ttft_ms > 0


def test_abort_frees_blocks_at_once_and_ends_the_stream():
    engine = make_engine()
    keep = engine.add_request("keep going " * 3, max_new_tokens=30)
    drop = engine.add_request("drop me " * 4, max_new_tokens=30, bypass_cache=True)
    for _ in range(3):
        engine.step()
    free_before = engine.get_num_free_blocks()
    assert engine.abort(drop.request_id)
    assert engine.get_num_free_blocks() == free_before + (32 + 3) // P + 1
    deltas = list(drop)
    assert deltas[-1].finished and deltas[-1].completion.finish_reason == "abort"
    assert not engine.abort(drop.request_id)
    while engine.has_unfinished():
        engine.step()
    assert keep.completion.token_ids == alone("keep going " * 3, max_new_tokens=30).token_ids
    engine.pool.check_invariants()


def test_prompts_too_long_or_empty_are_refused():
    with pytest.raises(ValueError, match="161 tokens; this engine takes at most 160"):
        make_engine().add_request("a" * 161)
    with pytest.raises(ValueError, match="40 tokens; this engine takes at most 32"):
        make_engine(num_blocks=4).add_request("a" * 40)
    with pytest.raises(ValueError, match="empty"):
        make_engine().add_request("")
    with pytest.raises(ValueError, match="token ids must be in"):
        make_engine().add_request([1, 300])


def test_a_sequence_stops_at_the_maximum_length():
    out = make_engine(num_blocks=4).generate(["k" * 28], max_new_tokens=50)[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 33


# ---- the remote tier hook ------------------------------------------------------------------

class DictTier(Tier):
    """Holds pages written through on_page_full; fills at most `max_fill` pages per call."""

    def __init__(self, engine_ref, max_fill=None, fail=False):
        self.engine_ref = engine_ref  # a one-item list, filled once the engine exists
        self.pages: dict[bytes, np.ndarray] = {}
        self.parents: dict[bytes, bytes] = {}
        self.calls = []
        self.max_fill = max_fill
        self.fail = fail

    def lookup(self, keys, context):
        self.calls.append(("lookup", len(keys), context))
        if self.fail:
            raise ConnectionError("node down")
        n = 0
        while n < len(keys) and keys[n] in self.pages:
            n += 1
        return n

    def fill(self, keys, block_ids, context):
        self.calls.append(("fill", len(keys), context))
        pool = self.engine_ref[0].kv_pool
        count = len(keys) if self.max_fill is None else min(self.max_fill, len(keys))
        for key, block in zip(keys[:count], block_ids[:count]):
            pool[block] = self.pages[key]
        if count < len(keys):
            pool[block_ids[count]] = 7.0  # a half-written page must not matter: it is computed
        return count

    def on_page_full(self, key, parent_key, block_id, context):
        self.calls.append(("page", key, context))
        self.parents[key] = parent_key
        self.pages[key] = self.engine_ref[0].kv_pool[block_id].copy()


def engine_with_tier(**tier_options):
    ref = []
    tier = DictTier(ref, **tier_options)
    engine = make_engine(tier=tier)
    ref.append(engine)
    return engine, tier


def test_full_pages_are_announced_to_the_tier_with_their_parents():
    engine, tier = engine_with_tier()
    out = engine.generate(["w" * 21], max_new_tokens=12, tier_context="ctx-1")[0]
    computed = out.prompt_token_ids + out.token_ids[:-1]  # 32 tokens with K/V: 4 full pages
    keys = page_keys(engine.fingerprint, computed, P)
    assert [c[1] for c in tier.calls if c[0] == "page"] == keys
    assert all(c[2] == "ctx-1" for c in tier.calls)
    assert tier.parents == {k: (keys[i - 1] if i else b"") for i, k in enumerate(keys)}


def test_pages_filled_by_the_tier_give_the_tokens_of_a_cold_run():
    source, tier = engine_with_tier()
    prompt = "v" * 19 + "the rest of it"  # 33 tokens: 4 reusable pages
    source.generate([prompt[:30]], max_new_tokens=3)  # 32 tokens computed: pages 0-3 reach the tier
    cold = alone(prompt, max_new_tokens=10)
    for max_fill, expected_pages in ((None, 3), (1, 1), (0, 0)):
        engine, fresh = engine_with_tier(max_fill=max_fill)
        fresh.pages, fresh.parents = dict(tier.pages), dict(tier.parents)
        out = engine.generate([prompt], max_new_tokens=10, tier_context=["node-a"])[0]
        assert out.token_ids == cold.token_ids
        assert out.usage.cached_tokens_remote == expected_pages * P and out.usage.cached_tokens_local == 0
        assert out.usage.computed_tokens == 33 - expected_pages * P
        assert ("lookup", 4, ["node-a"]) in fresh.calls and ("fill", 3, ["node-a"]) in fresh.calls
        engine.pool.check_invariants()
        again = engine.generate([prompt], max_new_tokens=10, tier_context=["node-a"])[0]
        assert again.token_ids == cold.token_ids and again.usage.cached_tokens_local == 32


def test_a_prompt_whose_every_page_the_tier_holds_computes_its_last_token_alone():
    source, tier = engine_with_tier()
    prompt = "p" * (4 * P)  # four full pages, all of them reused
    cold = source.generate([prompt], max_new_tokens=5)[0]
    engine, fresh = engine_with_tier()
    fresh.pages, fresh.parents = dict(tier.pages), dict(tier.parents)
    out = engine.generate([prompt], max_new_tokens=5, tier_context=["node-a"])[0]
    assert out.token_ids == cold.token_ids
    assert (out.usage.cached_tokens_remote, out.usage.cached_tokens_local, out.usage.computed_tokens) == (4 * P - 1, 0, 1)
    assert ("lookup", 4, ["node-a"]) in fresh.calls and ("fill", 4, ["node-a"]) in fresh.calls
    assert engine.model.forward_calls[0].token_ids.tolist() == [ord("p")]   # the last token alone
    assert list(engine.model.forward_calls[0].cached_lens) == [4 * P]
    engine.pool.check_invariants()


def test_the_tier_sees_the_whole_chain_and_a_failing_tier_costs_nothing():
    engine, tier = engine_with_tier()
    engine.generate(["u" * 20], max_new_tokens=1)  # pages 0-1 reach the tier
    tier.calls.clear()
    out = engine.generate(["u" * 20 + "more text here"], max_new_tokens=5)[0]
    assert out.usage.cached_tokens_local == 16
    assert tier.calls[0] == ("lookup", 4, None)  # local hits included: the node's copy stays fresh
    assert not [c for c in tier.calls[1:] if c[0] == "fill"]  # the tier's pages are the ones held locally
    broken, _ = engine_with_tier(fail=True)
    assert broken.generate(["t" * 40], max_new_tokens=5)[0].token_ids == alone("t" * 40, max_new_tokens=5).token_ids


def test_local_pages_the_tier_lacks_are_written_back_parents_first():
    engine, tier = engine_with_tier()
    first = engine.generate(["u" * 20], max_new_tokens=1, tier_context="node-x")[0]
    keys = page_keys(engine.fingerprint, first.prompt_token_ids, P)  # 2 full pages
    tier.pages.clear(), tier.parents.clear(), tier.calls.clear()  # as if placed on another node
    engine.generate(["u" * 20 + "more text here"], max_new_tokens=5, tier_context="node-y")
    announced = [c[1] for c in tier.calls if c[0] == "page"]
    assert announced[:2] == keys[:2]
    assert tier.parents[keys[0]] == b"" and tier.parents[keys[1]] == keys[0]
    np.testing.assert_array_equal(tier.pages[keys[1]], engine.kv_pool[engine.pool.lookup(keys)[1]])


def test_bypass_cache_skips_local_reuse_the_tier_and_write_back():
    engine, tier = engine_with_tier()
    engine.generate(["s" * 30], max_new_tokens=2)
    tier.calls.clear()
    cached = engine.pool.get_num_cached_blocks()
    out = engine.generate(["s" * 30], max_new_tokens=6, bypass_cache=True)[0]
    assert out.usage.cached_tokens_local == 0 and out.usage.computed_tokens == 30
    assert tier.calls == [] and engine.pool.get_num_cached_blocks() == cached
    assert out.token_ids == alone("s" * 30, max_new_tokens=6).token_ids


def test_generate_with_one_bad_prompt_runs_none_of_them():
    engine = make_engine()
    with pytest.raises(ValueError, match="empty"):
        engine.generate(["fine", ""], max_new_tokens=3)
    assert not engine.has_unfinished() and engine.get_num_free_blocks() == engine.pool.num_blocks


def test_closing_a_stream_early_aborts_its_request():
    engine = make_engine()
    stream = engine.stream("abandon this " * 2, max_new_tokens=30)
    first = next(stream)
    assert first.token_ids and engine.live_request_ids() == [first.request_id]
    stream.close()
    assert engine.live_request_ids() == [] and engine.get_num_free_blocks() == engine.pool.num_blocks
    assert not engine.wait_for_work(timeout=0.01)
    engine.add_request("again", max_new_tokens=1)
    assert engine.wait_for_work(timeout=0.01) and engine.num_waiting() == 1
