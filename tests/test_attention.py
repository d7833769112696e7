"""Paged attention equals dense attention on the same keys and values (docs/architecture.md, invariants)."""

import numpy as np
import pytest

from worker.model.attention import (KEYS, VALUES, AttentionMetadata, causal_attention, dense_attention, paged_attention,
                              write_kv)


def _setup(rng, lens, new, n_kv, group, hd, P, fp16, consecutive=False):
    """Random K/V for sequences of `lens` tokens stored in shuffled pool blocks (or, with
    `consecutive`, each sequence in a run of adjacent blocks); queries for the last `new[s]`
    tokens of each sequence. Returns everything both attentions need."""
    H = n_kv * group
    num_blocks = sum(-(-n // P) for n in lens) + 3
    pool = rng.standard_normal((num_blocks, 2, 2, n_kv, P, hd), dtype=np.float32)  # 2 layers; junk everywhere
    free = list(range(num_blocks - 1, -1, -1)) if consecutive else list(rng.permutation(num_blocks))
    tables = [np.array([free.pop() for _ in range(-(-n // P))], dtype=np.int32) for n in lens]
    ks, vs = [], []
    for n in lens:
        k = rng.standard_normal((n, n_kv, hd), dtype=np.float32)
        v = rng.standard_normal((n, n_kv, hd), dtype=np.float32)
        if fp16:
            k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        ks.append(k)
        vs.append(v)
    # Store every token's K/V (layer 1) through the write path.
    all_pos = np.concatenate([np.arange(n) for n in lens])
    all_starts = np.concatenate([[0], np.cumsum(lens)])
    meta_all = AttentionMetadata.build(all_pos, all_starts, np.array(lens), tables, pool.shape)
    write_kv(pool, 1, meta_all, np.concatenate(ks), np.concatenate(vs))
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lens, new)])
    starts = np.concatenate([[0], np.cumsum(new)])
    meta = AttentionMetadata.build(positions, starts, np.array(lens), tables, pool.shape)
    q = rng.standard_normal((len(positions), H, hd), dtype=np.float32)
    return pool, meta, q, ks, vs, positions, starts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fp16", [False, True])
def test_paged_equals_dense_random_shapes(seed, fp16):
    rng = np.random.default_rng(seed)
    n_kv, group = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4]))
    hd, P = int(rng.choice([8, 16, 32])), int(rng.choice([1, 4, 16]))
    S = int(rng.integers(1, 6))
    lens = [int(x) for x in rng.integers(1, 70, S)]
    # A mix of decodes (1 new token) and prefills on top of a cached prefix (several new tokens).
    new = [1 if rng.random() < 0.5 else int(rng.integers(1, n + 1)) for n in lens]
    pool, meta, q, ks, vs, positions, starts = _setup(rng, lens, new, n_kv, group, hd, P, fp16)
    scale = 1.0 / np.sqrt(hd)
    got = paged_attention(q, pool, 1, meta, float(scale))
    for s in range(S):
        rows = slice(starts[s], starts[s + 1])
        want = dense_attention(q[rows], ks[s], vs[s], positions[rows], float(scale))
        np.testing.assert_allclose(got[rows], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_a_float16_pool_attends_bit_for_bit_as_a_float32_pool_of_its_values(seed):
    """The pool kept in float16 (float16 KV): stored by rounding, read back exactly (note 7)."""
    rng = np.random.default_rng(100 + seed)
    n_kv, group, hd, P = int(rng.integers(1, 4)), int(rng.choice([1, 2, 4])), int(rng.choice([8, 64])), 16
    lens = [int(x) for x in rng.integers(1, 200, int(rng.integers(1, 6)))]
    new = [1 if rng.random() < 0.5 else int(rng.integers(1, n + 1)) for n in lens]
    pool, meta, q, _, _, positions, _ = _setup(rng, lens, new, n_kv, group, hd, P, fp16=True)
    half = pool.astype(np.float16)
    single = half.astype(np.float32)
    k, v = (rng.standard_normal((len(positions), n_kv, hd), dtype=np.float32) * 300 for _ in range(2))
    write_kv(half, 0, meta, k, v)   # rounded by the assignment
    write_kv(single, 0, meta, k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(half.astype(np.float32).view(np.uint32), single.view(np.uint32))
    for layer in (0, 1):
        want = paged_attention(q, single, layer, meta, 0.125)
        got = paged_attention(q, half, layer, meta, 0.125)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_decode_batch_of_different_lengths_gqa():
    rng = np.random.default_rng(42)
    lens = [1, 5, 16, 17, 64, 33]
    pool, meta, q, ks, vs, positions, starts = _setup(rng, lens, [1] * len(lens), 2, 3, 16, 16, False)
    assert sum(len(g.rows) for g in meta.decode_groups) == len(lens) and not meta.prefills
    assert len(meta.decode_groups) > 1   # lengths 1..64 blocks apart: grouped to limit padding
    got = paged_attention(q, pool, 1, meta, 0.25)
    for s in range(len(lens)):
        want = dense_attention(q[s:s + 1], ks[s], vs[s], positions[s:s + 1], 0.25)
        np.testing.assert_allclose(got[s:s + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("consecutive", [True, False])
def test_decode_equals_dense_over_adjacent_and_scattered_blocks(consecutive):
    rng = np.random.default_rng(7)
    lens = [40, 33, 48, 1, 47, 16]
    pool, meta, q, ks, vs, positions, starts = _setup(rng, lens, [1] * len(lens), 3, 2, 8, 4, False, consecutive)
    adjacent = []   # per sequence: are its blocks a run of adjacent blocks?
    for group in meta.decode_groups:
        for i, s in enumerate(group.rows):
            blocks = group.plan.rows[i, 0, 0, : -(-lens[s] // 4)] // (2 * 2 * 3)   # 2 layers, K|V, 3 heads
            adjacent.append(bool((np.diff(blocks) == 1).all()))
    assert all(adjacent) if consecutive else not any(adjacent[:3])
    got = paged_attention(q, pool, 1, meta, 0.35)
    for s in range(len(lens)):
        want = dense_attention(q[s:s + 1], ks[s], vs[s], positions[s:s + 1], 0.35)
        np.testing.assert_allclose(got[s:s + 1], want, atol=2e-5, rtol=1e-4)


def test_gather_of_keys_or_values_alone_is_that_half_of_the_pages():
    rng = np.random.default_rng(5)
    P, n_kv, hd = 4, 2, 8
    pool = rng.standard_normal((7, 3, 2, n_kv, P, hd), dtype=np.float32)
    tables = [np.array([6, 1, 3]), np.array([2, 0])]
    meta = AttentionMetadata.build(np.array([9, 5]), np.array([0, 1, 2]), np.array([10, 6]), tables, pool.shape)
    (group,) = meta.decode_groups
    for parts, kv in ((KEYS, 0), (VALUES, 1)):
        got = group.plan.gather(pool, 2, meta, parts)[:, 0].copy()      # [2 seqs, KV, 3 blocks * P, hd]
        for s, table in enumerate(tables):
            want = np.concatenate([pool[b, 2, kv] for b in table], axis=1)   # [KV, len * P, hd]
            np.testing.assert_array_equal(got[s, :, : want.shape[1]], want)
    both = group.plan.gather(pool, 2, meta)
    np.testing.assert_array_equal(both[:, 1], got)                      # the values half of a full gather


def test_write_kv_lands_in_the_block_table_slots():
    rng = np.random.default_rng(1)
    P, n_kv, hd = 4, 2, 8
    pool = np.zeros((6, 1, 2, n_kv, P, hd), np.float32)
    table = np.array([5, 2, 0], dtype=np.int32)
    k = rng.standard_normal((10, n_kv, hd), dtype=np.float32)
    v = rng.standard_normal((10, n_kv, hd), dtype=np.float32)
    meta = AttentionMetadata.build(np.arange(10), np.array([0, 10]), np.array([10]), [table], pool.shape)
    write_kv(pool, 0, meta, k, v)
    for p in range(10):
        np.testing.assert_array_equal(pool[table[p // P], 0, 0, :, p % P], k[p])
        np.testing.assert_array_equal(pool[table[p // P], 0, 1, :, p % P], v[p])
    assert not pool[[1, 3, 4]].any()


def test_causal_attention_ignores_future_keys():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((5, 4, 8), dtype=np.float32)
    k = rng.standard_normal((2, 9, 8), dtype=np.float32)
    v = rng.standard_normal((2, 9, 8), dtype=np.float32)
    pos = np.arange(4, 9)
    out = causal_attention(q, k, v, pos, 0.3)
    k2, v2 = k.copy(), v.copy()
    k2[:, 6:] = 100.0  # changes only keys after the first two queries' positions
    v2[:, 6:] = -100.0
    out2 = causal_attention(q, k2, v2, pos, 0.3)
    np.testing.assert_array_equal(out[:2], out2[:2])
    assert not np.allclose(out[2:], out2[2:])
    want = dense_attention(q, k.transpose(1, 0, 2), v.transpose(1, 0, 2), pos, 0.3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-4)
