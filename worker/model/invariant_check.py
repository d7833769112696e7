"""The check at load that invariant numerics hold here (worker/model/invariant.py): this machine's
BLAS and NumPy give a row the same bits in every batch and chunk shape a forward uses."""

from __future__ import annotations

import functools

import numpy as np

from .attention import AttentionMetadata, paged_attention, write_kv
from .invariant import (KEY_TILE, PANEL, SMALL_MNK, WIDE_ROWS, InvariantUnavailable, Linear, blas_threads, chained,
                        thread_counts)
from .layers import gelu_tanh_, layer_norm, rms_norm, silu_


def verify_invariant(config) -> None:
    """Raise InvariantUnavailable unless this machine's BLAS and NumPy give a row the same bits in
    every batch and chunk shape the forward uses (random data: products of the model's inner
    dimensions, attention with its heads, norms and activations). A few tens of ms."""
    c = config
    for K in sorted({c.d_model, c.d_ff, c.n_heads * c.head_dim}):
        _check_products(K)
    with blas_threads(1):   # as the forward's attention runs (blas.py)
        _check_attention(c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim)
    _check_rows(c.d_model)


@functools.lru_cache(maxsize=None)
def _check_products(K: int) -> None:
    rng = np.random.default_rng(K + 1)
    linear = Linear(rng.standard_normal((K, 2 * PANEL), dtype=np.float32))
    m0 = SMALL_MNK // (K * PANEL)
    sizes = sorted({1, 2, 3, 5, 8, 17, max(1, m0), m0 + 1, 2 * m0 + 5, WIDE_ROWS - 1, WIDE_ROWS + 3})
    x = rng.standard_normal((sizes[-1] + 1, K), dtype=np.float32)
    want = np.concatenate([chained(x[:x.shape[0] // 2 * 2], linear.panels[p:p + 1], linear.blocks)
                           for p in range(2)], axis=1)
    for M in sizes:
        for threads in thread_counts():
            with blas_threads(threads):
                got = x[1:M + 1] @ linear
            if not np.array_equal(got, want[1:M + 1]):
                raise InvariantUnavailable(f"a product of {M} rows over K={K} sums in another order "
                                           f"on {threads} BLAS thread(s)")


@functools.lru_cache(maxsize=None)
def _check_attention(n_kv: int, group: int, hd: int) -> None:
    """Three sequences computed whole, in chunks, and their last tokens as one decode step."""
    rng = np.random.default_rng(hd)
    P, lens = 16, [KEY_TILE + 37, 21, 2 * KEY_TILE + 5]
    blocks = [-(-n // P) for n in lens]
    pool = np.zeros((sum(blocks) + 1, 1, 2, n_kv, P, hd), dtype=np.float32)
    free = list(rng.permutation(len(pool)))
    tables = [np.array([free.pop() for _ in range(b)], dtype=np.int32) for b in blocks]
    q = [rng.standard_normal((n, n_kv * group, hd), dtype=np.float32) for n in lens]

    def attend(spans) -> list[np.ndarray]:   # spans: (sequence, first, end) -> queries [first, end) in one step
        positions = np.concatenate([np.arange(a, b) for _, a, b in spans])
        starts = np.concatenate([[0], np.cumsum([b - a for _, a, b in spans])])
        meta = AttentionMetadata.build(positions, starts, np.array([b for _, _, b in spans]),
                                       [tables[s] for s, _, _ in spans], pool.shape, invariant=True)
        out = paged_attention(np.concatenate([q[s][a:b] for s, a, b in spans]), pool, 0, meta, 0.125)
        return [out[starts[i]:starts[i + 1]] for i in range(len(spans))]

    everything = [(s, 0, n) for s, n in enumerate(lens)]
    kv = [rng.standard_normal((n, n_kv, hd), dtype=np.float32) for n in lens]
    positions = np.concatenate([np.arange(n) for n in lens])
    meta = AttentionMetadata.build(positions, np.concatenate([[0], np.cumsum(lens)]), np.array(lens), tables,
                                   pool.shape)
    write_kv(pool, 0, meta, np.concatenate(kv), np.concatenate(kv[::-1])[::-1].copy())
    whole = attend(everything)
    pieces = [attend([(0, 0, 100)])[0], attend([(0, 100, lens[0] - 1), (2, 3, 40)])[0], attend([(0, lens[0] - 1, lens[0])])[0]]
    decode = attend([(s, n - 1, n) for s, n in enumerate(lens)])
    ok = np.array_equal(np.concatenate(pieces), whole[0]) and all(
        np.array_equal(d, w[-1:]) for d, w in zip(decode, whole))
    if not ok:
        raise InvariantUnavailable(f"attention over {n_kv} KV heads x {group} of head_dim {hd} sums in another "
                                   "order in a decode step than in a prefill")


@functools.lru_cache(maxsize=None)
def _check_rows(d: int) -> None:
    """Norms reduce a row alone; exp and tanh treat an element alike wherever it sits."""
    rng = np.random.default_rng(d)
    x = rng.standard_normal((37, d), dtype=np.float32)
    g, b = rng.standard_normal(d, dtype=np.float32), rng.standard_normal(d, dtype=np.float32)
    rows = (lambda y: layer_norm(y, g, b, 1e-5), lambda y: rms_norm(y, g, 1e-6))
    elementwise = (lambda y: gelu_tanh_(y.copy()), lambda y: silu_(y.copy()), np.exp, np.tanh)
    for f in rows + elementwise:
        whole = f(x)
        if not all(np.array_equal(f(x[i:i + 1]), whole[i:i + 1]) for i in (0, 5, 36)) or (f in elementwise and not
                np.array_equal(f(x.reshape(-1)[3:3 + d]), whole.reshape(-1)[3:3 + d])):
            raise InvariantUnavailable("an elementwise or row operation of NumPy depends on its neighbours")
