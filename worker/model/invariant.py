"""Batch- and chunk-invariant numerics: a row's result depends on that row alone.

OpenBLAS sums a product's elements in an order that depends on the product's shape: one row goes
to a matrix-vector kernel, small products to small-matrix kernels, large ones to the packed
kernel, each with an order of its own. The same token then gets other last bits in another chunk,
beside other requests, or fetched from a cache that another chunking filled. Here every product is
cut so that each element is summed in one order, whatever runs it; invariant_check.py checks it at load.

Weight products (`Linear`). The packed kernel sums each element as an FMA chain over blocks of
the inner dimension K (`k_blocks`, found by calibration against OpenBLAS's own rule) and adds the
blocks' chains in order; the small-matrix kernel chains all of K at once and the matrix-vector
kernel sums otherwise. So a product the small kernel would take runs block by block, the blocks
added in the same order, and a single row runs as two.

Weights are kept in panels of 64 output columns, [panels, K, 64]: every call has 64 columns (a
multiple of the kernels' 16-float vectors, which keeps the small kernel on its chain) and a
panel's rows lie close together, which the prefetcher follows, so one row costs what a
matrix-vector product costs. A product of many rows copies the panels back into one [K, N]
matrix first, so the packed kernel packs the rows once rather than once a panel.

Attention scores q.k run in calls small enough for OpenBLAS's small kernel to take every one,
with keys a multiple of 16, so each score is summed in one order in decode and prefill alike.
Softmax denominators and the weighted sum of values run over tiles of KEY_TILE keys at fixed
positions, each tile one chain, then the tiles in order; keys past a query are weighted 0 and add
exactly nothing, so the number of keys gathered does not matter. Everything else a forward does
(norms, RoPE, activations, exp) is elementwise or a reduction over one row of fixed length.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .blas import split_workers

log = logging.getLogger("worker.model")

PANEL = 64                 # output columns per weight panel
SMALL_MNK = 1_000_000      # OpenBLAS sends products of up to this many M*N*K to its small kernels
WIDE_ROWS = 256            # from this many rows a product runs on the whole weight,
WIDE_MAX = 1 << 22         # if it is no larger than this (floats): not a vocabulary's head
QK_CALL = 1200             # query rows x keys OpenBLAS's small kernel takes for q @ k.T
QK_ROWS, QK_KEYS = 16, 64  # a prefill's score tiles
KEY_TILE = 256             # keys summed as one chain in softmax and values
_Q_CANDIDATES = (448, 384, 256, 512, 320, 640, 192, 768, 128, 1024, 96, 64)
_U_CANDIDATES = (16, 8, 4, 32, 2, 1)


class InvariantUnavailable(RuntimeError):
    """The BLAS here does not sum in the orders this module relies on (another library or kernel)."""


class Linear:
    """x @ w with rows independent of each other and of how many there are.
    `x @ linear` works as for the array; `linear.weight()` gives the [K, N] array back."""

    __array_ufunc__ = None  # NumPy defers `x @ linear` to __rmatmul__

    def __init__(self, w: np.ndarray):
        K, N = w.shape
        n_panels = -(-N // PANEL)
        self.panels = np.zeros((n_panels, K, PANEL), dtype=np.float32)
        for p in range(n_panels):
            cols = w[:, p * PANEL:(p + 1) * PANEL]
            self.panels[p, :, :cols.shape[1]] = cols
        self.shape = (K, N)
        self.blocks, self.packed_splits = k_blocks(K)

    @property
    def T(self):
        raise TypeError("Linear has no transpose; build one from the transposed array")

    def weight(self) -> np.ndarray:
        K, N = self.shape
        return self.panels.transpose(1, 0, 2).reshape(K, -1)[:, :N]

    def rows_of_transpose(self, ids: np.ndarray) -> np.ndarray:
        """weight().T[ids] without building it (a tied embedding's lookup)."""
        ids = np.asarray(ids)
        return self.panels[ids // PANEL, :, ids % PANEL]

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        K, N = self.shape
        if x.ndim != 2 or x.shape[1] != K:
            raise ValueError(f"Linear {self.shape} cannot take x of shape {x.shape}")
        M = x.shape[0]
        if M == 1:  # never the matrix-vector kernel, which sums in another order
            x = np.concatenate([x, x])
        rows = x.shape[0]
        n_panels = self.panels.shape[0]
        out = np.empty((rows, n_panels * PANEL), dtype=np.float32)
        view = out.reshape(rows, n_panels, PANEL).transpose(1, 0, 2)   # [panels, rows, 64], written in place
        if self.packed_splits and rows >= WIDE_ROWS and self.panels.size <= WIDE_MAX:   # packed: k_blocks
            wide = _wide(self.panels)
            split(lambda r: np.matmul(x[r], wide, out=out[r]), rows, split_workers(rows))
        elif self.packed_splits and rows * K * PANEL > SMALL_MNK:
            split(lambda p: np.matmul(x, self.panels[p], out=view[p]), n_panels, split_workers(rows))
        else:
            _blockwise(x, self.panels, self.blocks, view)
        if M != rows or out.shape[1] != N:
            out = out[:M, :N]
        return out


def _blockwise(x: np.ndarray, panels: np.ndarray, blocks, view: np.ndarray) -> None:
    """view = sum over K blocks, in order, of each block's product: the packed kernel's order."""
    (a, b), rest = blocks[0], blocks[1:]
    np.matmul(x[:, a:b], panels[:, a:b], out=view)
    if rest:
        part = np.empty_like(view)
        for a, b in rest:
            np.matmul(x[:, a:b], panels[:, a:b], out=part)
            view += part


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_scratch = threading.local()   # each forward's thread its own whole-width weight


def _wide(panels: np.ndarray) -> np.ndarray:
    """The panels as one [K, panels * 64] matrix, in this thread's scratch (overwritten by the next call)."""
    n_panels, K, width = panels.shape
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < panels.size:
        buffer = _scratch.buffer = np.empty(panels.size, dtype=np.float32)
    wide = buffer[:panels.size].reshape(K, n_panels * width)
    np.copyto(wide.reshape(K, n_panels, width), panels.transpose(1, 0, 2))
    return wide


def split(work, n: int, workers: int) -> None:
    """work(part) over `workers` threads, each a share of range(n) (panels, rows or heads; blas.py)."""
    global _pool
    workers = min(workers, n)
    if workers <= 1:
        work(slice(0, n))
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2, thread_name_prefix="invariant-blas")
    bounds = np.linspace(0, n, workers + 1).astype(int)
    shares = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    futures = [_pool.submit(work, share) for share in shares[1:]]
    work(shares[0])
    for f in futures:
        f.result()


class TiedEmbedding:
    """Embedding rows read from the head's panels (a tied model keeps one copy of the table)."""

    def __init__(self, head: Linear):
        self.head = head

    def __getitem__(self, ids) -> np.ndarray:
        return self.head.rows_of_transpose(ids)


def _rule(K: int, Q: int, U: int, threaded: bool) -> tuple[tuple[int, int], ...]:
    """OpenBLAS's split of K (driver/level3/level3.c, level3_thread.c)."""
    blocks, start = [], 0
    while start < K:
        n = K - start
        if n >= 2 * Q:
            n = Q
        elif n > Q:
            n = (n + 1) // 2 if threaded else (n // 2 + U - 1) // U * U
        blocks.append((start, start + n))
        start += n
    return tuple(blocks)


@functools.lru_cache(maxsize=None)
def k_blocks(K: int) -> tuple[tuple[tuple[int, int], ...], bool]:
    """(blocks, packed_splits): the K blocks whose chains a product adds, and whether the packed
    kernel splits K that way itself (on one thread and on several). When no rule fits, blocks of
    128 and every product block by block (slower, still invariant)."""
    rng = np.random.default_rng(K)
    panel = rng.standard_normal((1, K, PANEL), dtype=np.float32)
    rows = max(SMALL_MNK // (K * PANEL) + 2, 64) // 2 * 2   # even: chained takes rows two by two
    x = rng.standard_normal((rows, K), dtype=np.float32)
    packed = []
    for threads in thread_counts():
        with blas_threads(threads):
            packed.append(np.matmul(x, panel)[0])
    candidates = dict.fromkeys(_rule(K, q, u, t) for q in _Q_CANDIDATES for u in _U_CANDIDATES for t in (False, True))
    for blocks in candidates:
        if max(b - a for a, b in blocks) > 1024:
            continue
        summed = chained(x, panel, blocks)
        if all(np.array_equal(p, summed) for p in packed):
            return blocks, True
    fallback = _rule(K, 128, 16, False)
    log.info("the packed BLAS kernel splits K=%d by no known rule: its products run in blocks of 128", K)
    return fallback, False


def chained(x: np.ndarray, panel: np.ndarray, blocks) -> np.ndarray:
    """x @ panel[0] as block chains added in order, two rows per call (the small kernel's chain)."""
    out = np.empty((x.shape[0], PANEL), dtype=np.float32)
    for r in range(0, x.shape[0] - 1, 2):
        view = out[r:r + 2][None]
        _blockwise(x[r:r + 2], panel, blocks, view)
    return out


def thread_counts() -> list[int]:
    from .blas import _blas_controller

    most = max((lib.num_threads for lib in _blas_controller().select(user_api="blas").lib_controllers), default=1)
    return sorted({1, min(2, max(most, os.cpu_count() or 1))})


def blas_threads(count: int):
    from .blas import _blas_controller

    return _blas_controller().limit(limits=count, user_api="blas")


# ----------------------------------------------------------------------------- attention

def decode_scores(q: np.ndarray, k: np.ndarray, out: np.ndarray) -> None:
    """q [..., G, hd] (G >= 2) . k [..., L, hd] -> out [..., G, L], in calls of <= QK_CALL rows x keys."""
    G = q.shape[-2]
    for rows in np.array_split(np.arange(G), -(-G // QK_ROWS)):   # >= 2 rows each (G > 16: >= 8)
        r = slice(rows[0], rows[-1] + 1)
        step = QK_CALL // len(rows) // 16 * 16
        for a in range(0, k.shape[-2], step):
            _scores(q[..., r, :], k[..., a:a + step, :], out[..., r, a:a + step])


def prefill_scores(q: np.ndarray, k: np.ndarray, out: np.ndarray, last: np.ndarray | None = None) -> None:
    """q [KV, G, R, hd] (R a multiple of QK_ROWS) . k [KV, L, hd] -> out [KV, G, R, L'] (L <= L'), in
    tiles of QK_ROWS x QK_KEYS (a NumPy call per column of tiles). last[t]: the last key row tile t
    sees; tiles wholly past it are -inf, not computed (a causal chunk's upper triangle)."""
    KV, G, R, hd = q.shape
    rows = q.reshape(KV, G, R // QK_ROWS, QK_ROWS, hd)
    tiles = out.reshape(KV, G, R // QK_ROWS, QK_ROWS, out.shape[-1])
    L = k.shape[1]
    for a in range(0, L, QK_KEYS):
        b = min(L, a + QK_KEYS)
        t0 = 0 if last is None else int(np.searchsorted(last, a))   # the first row tile that sees key a
        if t0:
            tiles[:, :, :t0, :, a:b] = -np.inf
        if t0 < rows.shape[2]:
            _scores(rows[:, :, t0:], k[:, None, None, a:b], tiles[:, :, t0:, :, a:b])


def _scores(q: np.ndarray, k: np.ndarray, out: np.ndarray) -> None:
    """One call: q @ k.T into out, keys made a multiple of 4 (the small kernel's own path)."""
    L = k.shape[-2]
    if L % 4:
        padded = np.zeros(k.shape[:-2] + (L + 4 - L % 4, k.shape[-1]), dtype=np.float32)
        padded[..., :L, :] = k
        out[...] = np.matmul(q, padded.swapaxes(-1, -2))[..., :L]
        return
    np.matmul(q, k.swapaxes(-1, -2), out=out)


def tile_sums(w: np.ndarray) -> np.ndarray:
    """[..., L] (L a multiple of KEY_TILE) -> [..., 1]: each tile's pairwise sum, then the tiles in order."""
    parts = w.reshape(*w.shape[:-1], -1, KEY_TILE).sum(axis=-1)
    total = parts[..., :1].copy()
    for t in range(1, parts.shape[-1]):
        total += parts[..., t:t + 1]
    return total


def weighted_values(w: np.ndarray, v: np.ndarray) -> np.ndarray:
    """w [..., R, L'] @ v [..., L, hd] -> [..., R, hd], L <= L' and w 0 past L: each tile's product
    (one chain over its keys: those past L would add exact zeros), then the tiles in order. R >= 2;
    hd is padded to a multiple of 16 when its rest is 1..8 (the small kernel's other path)."""
    L, hd = v.shape[-2], v.shape[-1]
    if 0 < hd % 16 <= 8:
        padded = np.zeros(v.shape[:-1] + (hd + 16 - hd % 16,), dtype=np.float32)
        padded[..., :hd] = v
        return weighted_values(w, padded)[..., :hd]
    total = np.matmul(w[..., :min(L, KEY_TILE)], v[..., :KEY_TILE, :])
    if L > KEY_TILE:
        part = np.empty_like(total)
        for a in range(KEY_TILE, L, KEY_TILE):
            b = min(L, a + KEY_TILE)
            np.matmul(w[..., a:b], v[..., a:b, :], out=part)
            total += part
    return total


def padded_keys(n: int) -> int:
    """Keys a step gathers for n: whole tiles."""
    return -(-n // KEY_TILE) * KEY_TILE
