"""Paged attention over the worker's KV pool, and a dense reference.

Pool layout (docs/architecture.md): kv_pool[block, layer, 0 = K | 1 = V, kv_head, offset, head_dim], in the
KV dtype (float32 or float16); attention itself runs in float32.
A sequence's block table maps its position p to block table[p // P], offset p % P.

New tokens' K/V are written into the pool first (write_kv), then attention reads every position
from the pool, so cached-prefix positions (filled by the engine) and new ones are treated alike.
Reads gather a sequence's pages head-major into a reused scratch buffer (GatherPlan), after which
attention is plain batched matmuls as over a dense cache. Decodes (one new token per sequence) run
many sequences at once in groups of similar length; a prefill (several new tokens of one sequence
on top of a cached prefix) attends causally in query chunks. With invariant numerics
(worker/model/invariant.py) each query's sums run in one order whatever its step holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.kv.quant import KVCodec
from worker.kv.window import first_read_block

from .gather import KEYS, VALUES, GatherPlan, gather_plan
from .blas import split_workers
from .invariant import (KEY_TILE, QK_ROWS, decode_scores, padded_keys, prefill_scores, split, tile_sums,
                        weighted_values)

# Largest score matrix a prefill builds at once (floats): 16 MiB. Also keeps chunks short enough
# that skipping keys after a chunk's last query saves most of the causal triangle.
MAX_SCORE_ELEMENTS = 4 * 1024 * 1024
PREFILL_QUERY_CHUNK = 128
# A decode group grows while its padded size stays within this factor of its real size.
MAX_PADDING = 1.25


@dataclass
class DecodeGroup:
    rows: np.ndarray        # [Sg] batch rows of these sequences' new tokens
    plan: GatherPlan
    bias: np.ndarray        # [Sg, MB * P]: 0 where a key is seen, -inf past the context length or the window


@dataclass
class PrefillSeq:
    start: int              # first row of this sequence's new tokens in the batch
    end: int                # one past its last row
    context_len: int        # tokens after this step
    positions: np.ndarray   # [end - start] absolute positions of the new tokens
    plan: GatherPlan
    first_position: int     # position of the first key gathered (a window skips the blocks before)


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query reads; built once per forward."""

    slot_blocks: np.ndarray     # [T] block of each new token
    slot_offsets: np.ndarray    # [T] offset of each new token within its block
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    max_gather_rows: int        # largest gather of any group or sequence
    scratch: np.ndarray | None = None   # the gather buffer, reused by every layer
    half_scratch: np.ndarray | None = None   # a float16 pool's rows before their conversion
    codec: KVCodec | None = None        # an int8 or int4 pool's
    byte_scratch: np.ndarray | None = None   # its rows' bytes before their decoding
    bytes_taken: tuple | None = None    # (plan, layer) whose bytes byte_scratch holds
    window: int | None = None   # sliding window: a query at p sees keys at p - window < j <= p
    written: np.ndarray | None = None   # rows whose K/V is stored; None: every row (cached_lens)
    invariant: bool = False     # invariant numerics (worker/model/invariant.py)

    @classmethod
    def build(cls, positions: np.ndarray, query_starts: np.ndarray, context_lens: np.ndarray,
              block_tables: list[np.ndarray], pool_shape: tuple[int, ...],
              window: int | None = None, cached_lens: np.ndarray | None = None,
              invariant: bool = False) -> "AttentionMetadata":
        P = pool_shape[4]
        if invariant and window is not None and KEY_TILE % P:
            raise ValueError(f"invariant numerics with a sliding window need pages that divide {KEY_TILE} tokens, "
                             f"got {P}")
        counts = np.diff(query_starts)
        written = None
        if cached_lens is not None:   # positions a cached page holds already are not written
            keep = positions >= np.repeat(np.asarray(cached_lens, dtype=np.int64), counts)
            written = None if keep.all() else np.flatnonzero(keep)
        slot_blocks = np.empty(len(positions), dtype=np.int64)
        for s in range(len(context_lens)):
            rows = slice(int(query_starts[s]), int(query_starts[s + 1]))
            slot_blocks[rows] = np.asarray(block_tables[s])[positions[rows] // P]
        n_blocks = [int(n) for n in (np.asarray(context_lens) + P - 1) // P]
        # With a sliding window, blocks are read from the first one the step's queries can see: the
        # cost of a token stays bounded by the window, and blocks before, maybe RELEASED, are never touched.
        readable = [first_read_block(int(positions[query_starts[s]]), window, P) for s in range(len(context_lens))]
        # Invariant numerics keep scores in whole KEY_TILE tiles from position 0: a window's first
        # block is rounded down to a tile and the keys before `readable` gathered hidden.
        first = [f // (KEY_TILE // P) * (KEY_TILE // P) for f in readable] if invariant and window else readable

        # Decodes are grouped by length, each group's tables padded to its longest (pad entries
        # repeat a real block, masked by `bias`), so padding stays within MAX_PADDING of the copy.
        groups = []
        decode_seqs = sorted(np.flatnonzero(counts == 1), key=lambda s: first[s] - n_blocks[s])
        while decode_seqs:
            group = [decode_seqs.pop(0)]
            total = longest = n_blocks[group[0]] - first[group[0]]
            while decode_seqs and (len(group) + 1) * longest <= MAX_PADDING * (
                    total + n_blocks[decode_seqs[0]] - first[decode_seqs[0]]):
                total += n_blocks[decode_seqs[0]] - first[decode_seqs[0]]
                group.append(decode_seqs.pop(0))
            plan = gather_plan([np.asarray(block_tables[s]) for s in group], [first[s] for s in group],
                         [n_blocks[s] for s in group], pool_shape, readable=[readable[s] for s in group])
            MB = plan.rows.shape[3]
            # absolute position of each gathered key; the query is at lens - 1
            key_positions = np.asarray([first[s] * P for s in group])[:, None] + np.arange(MB * P)[None, :]
            lens = np.asarray(context_lens)[group][:, None]
            hidden = key_positions >= lens
            if window is not None:
                hidden |= key_positions < lens - window
            bias = np.where(hidden, np.float32(-np.inf), np.float32(0))
            groups.append(DecodeGroup(np.asarray(query_starts)[group].astype(np.int64), plan, bias))

        prefills = []
        for s in np.flatnonzero(counts > 1):
            start, end = int(query_starts[s]), int(query_starts[s + 1])
            plan = gather_plan([np.asarray(block_tables[s])], [first[s]], [n_blocks[s]], pool_shape,
                               readable=[readable[s]])
            prefills.append(PrefillSeq(start, end, int(context_lens[s]), positions[start:end], plan, first[s] * P))
        sizes = [g.plan.rows.size for g in groups] + [p.plan.rows.size for p in prefills]
        return cls(slot_blocks, positions % P, groups, prefills, max(sizes), window=window, written=written,
                   invariant=invariant)


def write_kv(kv_pool: np.ndarray, layer: int, meta: AttentionMetadata, k: np.ndarray, v: np.ndarray) -> None:
    """Store new tokens' keys and values ([T, kv_heads, head_dim] each) in their pool slots (only
    the `written` rows when a cached page already holds the others'); a float16 pool rounds them,
    an int8 or int4 pool holds them encoded."""
    if meta.codec is not None:
        rows = slice(None) if meta.written is None else meta.written
        kv_pool[meta.slot_blocks[rows], layer, :, meta.slot_offsets[rows], :] = meta.codec.encode(k[rows], v[rows])
        return
    if meta.written is None:
        kv_pool[meta.slot_blocks, layer, 0, :, meta.slot_offsets, :] = k
        kv_pool[meta.slot_blocks, layer, 1, :, meta.slot_offsets, :] = v
        return
    rows = meta.written
    kv_pool[meta.slot_blocks[rows], layer, 0, :, meta.slot_offsets[rows], :] = k[rows]
    kv_pool[meta.slot_blocks[rows], layer, 1, :, meta.slot_offsets[rows], :] = v[rows]


def paged_attention(q: np.ndarray, kv_pool: np.ndarray, layer: int, meta: AttentionMetadata,
                    scale: float) -> np.ndarray:
    """Attention of new queries over their sequences' pages. q [T, n_heads, hd] -> [T, n_heads, hd]."""
    out = np.empty_like(q)
    decode = _decode_invariant if meta.invariant else _decode
    for group in meta.decode_groups:
        out[group.rows] = decode(q[group.rows], kv_pool, layer, meta, group, scale)
    for seq in meta.prefills:
        kv = seq.plan.gather(kv_pool, layer, meta)[0]         # [2, KV, nb*P, hd] from first_position on
        n = seq.context_len - seq.first_position
        k, v = kv[0, :, :n], kv[1, :, :n]
        out[seq.start:seq.end] = causal_attention(q[seq.start:seq.end], k, v, seq.positions - seq.first_position,
                                                  scale, meta.window, meta.invariant)
    return out


def _decode(q: np.ndarray, kv_pool: np.ndarray, layer: int, meta: AttentionMetadata, group: DecodeGroup,
            scale: float) -> np.ndarray:
    # q [S, H, hd] -> [S, H, hd]; keys, then values, gathered [S, KV, L, hd] (L = padded context).
    # Keys and values go through the same half of the scratch buffer, which stays in cache between
    # the copy and the matmul that reads it: less attention time at batch 8 than both at once.
    S, H, hd = q.shape
    k = group.plan.gather(kv_pool, layer, meta, KEYS)[:, 0]
    KV = k.shape[1]
    G = H // KV
    scores = np.matmul(q.reshape(S, KV, G, hd) * scale, k.swapaxes(-1, -2))   # [S, KV, G, L]
    scores += group.bias[:, None, None, :]
    weights, denom = _exp_normalizer_(scores)
    v = group.plan.gather(kv_pool, layer, meta, VALUES)[:, 0]          # overwrites k
    out = np.matmul(weights, v)                                        # [S, KV, G, hd]
    out /= denom
    return out.reshape(S, H, hd)


def _decode_invariant(q: np.ndarray, kv_pool: np.ndarray, layer: int, meta: AttentionMetadata,
                      group: DecodeGroup, scale: float) -> np.ndarray:
    """_decode in invariant numerics: the same math, each sum in a fixed order."""
    S, H, hd = q.shape
    k = group.plan.gather(kv_pool, layer, meta, KEYS)[:, 0]            # [S, KV, L, hd]
    KV, L = k.shape[1], k.shape[2]
    G = H // KV
    # A KV head's queries are two rows at least: one would go to the matrix-vector kernel.
    qs = np.empty((S, KV, max(G, 2), hd), dtype=q.dtype)
    np.multiply(q.reshape(S, KV, G, hd), scale, out=qs[:, :, :G])
    if G == 1:
        qs[:, :, 1] = qs[:, :, 0]
    scores = np.empty(qs.shape[:3] + (padded_keys(L),), dtype=np.float32)
    decode_scores(qs, k, scores[..., :L])
    scores[..., :L] += group.bias[:, None, None, :]
    scores[..., L:] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denom = tile_sums(scores)
    v = group.plan.gather(kv_pool, layer, meta, VALUES)[:, 0]          # overwrites k
    out = weighted_values(scores, v)                                   # [S, KV, G', hd]
    out /= denom
    return out[:, :, :G].reshape(S, H, hd)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                     scale: float, window: int | None = None, invariant: bool = False) -> np.ndarray:
    """Queries q [n, H, hd] at increasing q_positions over one sequence's keys/values k, v
    [KV, ctx, hd] (position j at index j), causal (and within `window` when given). Used by paged
    prefill and the dense runner; with invariant numerics if asked. GQA: the G query heads of a
    group share their K/V, one batched matmul per KV head; query chunks each read only the keys up
    to their last position and bound the score matrix (MAX_SCORE_ELEMENTS)."""
    if invariant:
        return _causal_invariant_split(q, k, v, q_positions, scale, window)
    n, H, hd = q.shape
    KV, ctx, _ = k.shape
    G = H // KV
    out = np.empty((n, KV, G, hd), dtype=q.dtype)
    chunk = max(1, min(PREFILL_QUERY_CHUNK, MAX_SCORE_ELEMENTS // (H * ctx)))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m = hi - lo
        keys = int(q_positions[hi - 1]) + 1                 # no query of this chunk sees past this
        # The scale multiplies the queries (G * m * hd floats), not the scores (G * m * keys): 64x
        # fewer for 16 queries over 1,024 keys; bit-identical for a power-of-two scale, else last bit.
        qc = np.empty((KV, G, m, hd), dtype=q.dtype)      # the queries head-major, scaled
        np.multiply(q[lo:hi].reshape(m, KV, G, hd).transpose(1, 2, 0, 3), scale, out=qc)
        scores = np.matmul(qc.reshape(KV, G * m, hd), k[:, :keys].transpose(0, 2, 1)).reshape(KV, G, m, keys)
        # Without a window, the keys up to the chunk's first query are seen by all its queries:
        # only the columns after it need the causal mask.
        masked = 0 if window is not None and keys > window else int(q_positions[lo]) + 1
        if masked < keys:
            j, p = np.arange(masked, keys)[None, :], q_positions[lo:hi, None]
            hidden = j > p if window is None else (j > p) | (j <= p - window)
            scores[..., masked:] += np.where(hidden, np.float32(-np.inf), np.float32(0))   # [m, keys - masked]
        weights, denom = _exp_normalizer_(scores)
        o = np.matmul(weights.reshape(KV, G * m, keys), v[:, :keys]).reshape(KV, G, m, hd)
        o /= denom
        out[lo:hi] = o.transpose(2, 0, 1, 3)
    return out.reshape(n, H, hd)


def _causal_invariant_split(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                            scale: float, window: int | None) -> np.ndarray:
    """_causal_invariant with its KV heads shared between the forward's threads (a head's result
    is the same whichever thread computes it, beside whichever others)."""
    n, H, hd = q.shape
    KV, ctx, _ = k.shape
    G = H // KV
    chunk = max(1, min(PREFILL_QUERY_CHUNK, MAX_SCORE_ELEMENTS // (H * padded_keys(ctx))))
    workers = split_workers(n)
    if workers <= 1 or KV < 2:
        return _causal_invariant(q, k, v, q_positions, scale, window, chunk)
    out = np.empty((n, H, hd), dtype=q.dtype)

    def heads(share: slice) -> None:
        h = slice(share.start * G, share.stop * G)
        out[:, h] = _causal_invariant(q[:, h], k[share], v[share], q_positions, scale, window, chunk)

    split(heads, KV, workers)
    return out


def _causal_invariant(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                      scale: float, window: int | None, chunk: int) -> np.ndarray:
    """causal_attention in invariant numerics; each head's queries padded to QK_ROWS."""
    n, H, hd = q.shape
    KV, ctx, _ = k.shape
    G = H // KV
    out = np.empty((n, KV, G, hd), dtype=q.dtype)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m = hi - lo
        keys = min(ctx, int(q_positions[hi - 1]) + 1)   # no query of this chunk sees past this
        rows = -(-m // QK_ROWS) * QK_ROWS
        qc = np.zeros((KV, G, rows, hd), dtype=q.dtype)
        np.multiply(q[lo:hi].reshape(m, KV, G, hd).transpose(1, 2, 0, 3), scale, out=qc[:, :, :m])
        scores = np.empty((KV, G, rows, padded_keys(keys)), dtype=np.float32)
        tile_last = q_positions[lo:hi][np.minimum(np.arange(QK_ROWS - 1, rows, QK_ROWS), m - 1)]
        prefill_scores(qc, k[:, :keys], scores, None if window is not None else tile_last)
        scores[..., keys:] = -np.inf
        real = scores[:, :, :m]
        masked = 0 if window is not None and keys > window else int(q_positions[lo]) + 1
        if masked < keys:
            j, p = np.arange(masked, keys)[None, :], q_positions[lo:hi, None]
            hidden = j > p if window is None else (j > p) | (j <= p - window)
            real[..., masked:keys] += np.where(hidden, np.float32(-np.inf), np.float32(0))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denom = tile_sums(scores)
        o = weighted_values(scores.reshape(KV, G * rows, -1), v[:, :keys])   # [KV, G * rows, hd]
        o /= denom.reshape(KV, G * rows, 1)
        out[lo:hi] = o.reshape(KV, G, rows, hd)[:, :, :m].transpose(2, 0, 1, 3)
    return out.reshape(n, H, hd)


def _exp_normalizer_(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax numerators in place over the last axis, and their sums (divide after the PV matmul:
    fewer elements than dividing the probabilities)."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x, x.sum(axis=-1, keepdims=True)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                    scale: float, window: int | None = None) -> np.ndarray:
    """Reference: queries [n, H, hd] at q_positions over contiguous keys/values [ctx, KV, hd]
    (position j at row j), causal. Plain and unoptimized on purpose."""
    n, H, hd = q.shape
    ctx, KV, _ = k.shape
    G = H // KV
    k = np.repeat(k, G, axis=1)                            # [ctx, H, hd]
    v = np.repeat(v, G, axis=1)
    scores = np.einsum("nhd,chd->hnc", q, k) * scale       # [H, n, ctx]
    j, p = np.arange(ctx)[None, None, :], np.asarray(q_positions)[None, :, None]
    scores = np.where(j > p, -np.inf, scores)
    if window is not None:
        scores = np.where(j <= p - window, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hnc,chd->nhd", probs, v).astype(q.dtype)
