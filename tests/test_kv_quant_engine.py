"""int8 and int4 KV in the engine (worker/kv/quant.py): paged attention over a quantized pool reads
what the dense reference reads, and a prompt computed, cached locally or fetched from a kvnode gets
the same answer in every KV dtype."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from remote_tier_helpers import GPT2_AND_LLAMA, PAGE_TOKENS, PARAMS, PROMPT, SHARED, engine
from remote_tier_helpers import models, node  # noqa: F401 - fixtures, asked for by name
from worker.model import ForwardBatch, kv_block_shape
from worker.model.dense import reference_logits
from worker.kv.quant import storage_dtype
from worker.remote.tier import Placement, RemoteTier

KV_DTYPES = ["float32", "float16", "int8", "int4"]
MODELS = GPT2_AND_LLAMA


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_paged_attention_over_a_quantized_pool_reads_what_the_reference_reads(models, name, kv_dtype):
    model = models[name]
    c = model.config
    ids = np.random.default_rng(0).integers(0, c.vocab_size, 70)
    pool = np.zeros((8, *kv_block_shape(c, kv_dtype, PAGE_TOKENS)), dtype=storage_dtype(kv_dtype))
    n = len(ids)
    batch = ForwardBatch(ids, np.arange(n), np.array([0, n]), np.array([n]), [np.arange(5)], all_logits=True)
    logits = model.forward(batch, pool, kv_dtype)
    # The reference attends densely, paged attention in fixed key tiles: last-bit differences in a
    # layer's output can move a later layer's K/V across a quantization step (seen: 6e-4 on tiny).
    np.testing.assert_allclose(logits, reference_logits(model, ids, kv_dtype), atol=2e-3, rtol=0)
    assert np.abs(logits - reference_logits(model, ids, "float32")).max() > 1e-2   # the KV really was quantized


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_prompt_computed_cached_or_fetched_gets_the_same_answer(models, node, name, kv_dtype):
    model = models[name]
    cold = engine(model, kv_dtype).generate([PROMPT], **PARAMS)[0]
    local = engine(model, kv_dtype)
    local.generate([SHARED + "First question?"], max_new_tokens=2)
    warm_local = local.generate([PROMPT], **PARAMS)[0]
    assert warm_local.usage.cached_tokens_local >= 8 * PAGE_TOKENS

    writer = engine(model, kv_dtype)
    served = node(model.page_bytes(kv_dtype, PAGE_TOKENS))
    assert writer.kv_pool[0].nbytes == model.page_bytes(kv_dtype, PAGE_TOKENS)
    placement = Placement([served.address])
    tier = RemoteTier(writer.kv_pool, kv_dtype)
    writer.attach_remote_tier(tier)
    try:
        writer.generate([SHARED + "First question?"], max_new_tokens=2, tier_context=placement)
        assert tier.flush(timeout_s=10.0) and tier.stats.pages_written >= 8
    finally:
        tier.close()
    reader = engine(model, kv_dtype)
    tier = RemoteTier(reader.kv_pool, kv_dtype, first_contact_wait_s=5.0, lookup_timeout_s=5.0)
    reader.attach_remote_tier(tier)
    try:
        warm = reader.generate([PROMPT], tier_context=placement, **PARAMS)[0]
        assert tier.stats.pages_fetched + tier.stats.pages_in_place >= 8 and tier.stats.pages_rejected == 0
    finally:
        tier.close()
    assert warm.token_ids == cold.token_ids == warm_local.token_ids
    assert warm.usage.cached_tokens_remote == warm_local.usage.cached_tokens_local
    fetched = [reader.pool.key_to_block[key] for key in writer.pool.key_to_block if key in reader.pool.key_to_block]
    assert fetched, "no page of the writer's reached the reader's pool"
    for key, block in writer.pool.key_to_block.items():   # the bytes the writer computed are the bytes read
        if key in reader.pool.key_to_block:
            np.testing.assert_array_equal(reader.kv_pool[reader.pool.key_to_block[key]], writer.kv_pool[block])


def test_a_worker_refuses_a_kvnode_of_another_kv_dtype_with_one_line_naming_both(models, node, caplog):
    model = models["tiny"]
    served = node(model.page_bytes("int8", PAGE_TOKENS))
    reader = engine(model, "int4")
    tier = RemoteTier(reader.kv_pool, "int4", first_contact_wait_s=5.0)
    try:
        with caplog.at_level(logging.WARNING, logger="worker.remote"):
            for _ in range(2):
                assert tier.lookup([bytes(16)], Placement([served.address])) == 0
        refusals = [r.getMessage() for r in caplog.records if "refusing kvnode" in r.getMessage()]
        assert len(refusals) == 1
        assert "(int8 KV of this model)" in refusals[0] and "--kv-dtype int4" in refusals[0], refusals[0]
    finally:
        tier.close()
