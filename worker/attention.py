"""Paged attention over the worker's KV pool, and a dense reference.

Pool layout (DESIGN.md): kv_pool[block, layer, 0 = K | 1 = V, kv_head, offset, head_dim], float32.
A sequence's block table maps its position p to block table[p // P], offset p % P.

Notes:
1. New tokens' K/V are written into the pool first, then attention reads every position from the
   pool, so cached-prefix positions (filled by the engine) and new ones are treated alike.
2. Decode (one new token per sequence) runs all sequences in one pass: their blocks are gathered
   into a padded [S, max_blocks] table, positions past each context length are masked out.
   Scores are computed block by block (batched matmul over [S, block, kv_head]) so the gathered
   keys are never re-laid out.
3. Prefill (several new tokens of one sequence, on top of a cached prefix) loops over sequences;
   within one, queries attend causally with one batched matmul per KV head (GQA: the G query heads
   of a group share their K/V), in query chunks that bound the score matrix's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Largest score matrix a prefill builds at once (floats): 64 MiB.
MAX_SCORE_ELEMENTS = 16 * 1024 * 1024


@dataclass
class PrefillSeq:
    start: int              # first row of this sequence's new tokens in the batch
    end: int                # one past its last row
    blocks: np.ndarray      # [n_blocks] block ids covering positions [0, context_len)
    context_len: int        # tokens after this step
    positions: np.ndarray   # [end - start] absolute positions of the new tokens


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and what each query reads; built once per forward."""

    page_tokens: int
    slot_blocks: np.ndarray     # [T] block of each new token
    slot_offsets: np.ndarray    # [T] offset of each new token within its block
    decode_rows: np.ndarray     # [Sd] rows of sequences that add exactly one token
    decode_blocks: np.ndarray   # [Nb] their blocks, sequence after sequence (no padding)
    decode_block_seq: np.ndarray  # [Nb] which decode sequence (0..Sd-1) each block belongs to
    decode_block_idx: np.ndarray  # [Nb] index of the block within its sequence's table
    decode_first_block: np.ndarray  # [Sd] where each sequence's blocks start in decode_blocks
    decode_bias: np.ndarray     # [Sd, max_blocks * P] 0 where a position exists, -inf past context_len
    prefills: list[PrefillSeq]  # sequences that add several tokens

    @classmethod
    def build(cls, positions: np.ndarray, query_starts: np.ndarray, context_lens: np.ndarray,
              block_tables: list[np.ndarray], page_tokens: int) -> "AttentionMetadata":
        P = page_tokens
        num_seqs = len(context_lens)
        counts = np.diff(query_starts)
        slot_blocks = np.empty(len(positions), dtype=np.int64)
        for s in range(num_seqs):
            rows = slice(int(query_starts[s]), int(query_starts[s + 1]))
            slot_blocks[rows] = block_tables[s][positions[rows] // P]
        slot_offsets = positions % P

        decode_seqs = np.flatnonzero(counts == 1)
        decode_rows = query_starts[decode_seqs].astype(np.int64)
        n_blocks = (context_lens + P - 1) // P
        decode_nb = n_blocks[decode_seqs]
        max_blocks = int(decode_nb.max()) if len(decode_seqs) else 0
        decode_blocks = np.concatenate(
            [np.asarray(block_tables[s][: n_blocks[s]], dtype=np.int64) for s in decode_seqs] or [np.zeros(0, np.int64)])
        decode_block_seq = np.repeat(np.arange(len(decode_seqs)), decode_nb)
        decode_first_block = np.concatenate([[0], np.cumsum(decode_nb)[:-1]]).astype(np.int64)
        decode_block_idx = np.arange(len(decode_blocks)) - decode_first_block[decode_block_seq]
        bias = np.zeros((len(decode_seqs), max_blocks * P), dtype=np.float32)
        bias[np.arange(max_blocks * P)[None, :] >= context_lens[decode_seqs][:, None]] = -np.inf

        prefills = []
        for s in np.flatnonzero(counts > 1):
            start, end = int(query_starts[s]), int(query_starts[s + 1])
            ctx = int(context_lens[s])
            prefills.append(PrefillSeq(start, end, np.asarray(block_tables[s][: int(n_blocks[s])], dtype=np.int64),
                                       ctx, positions[start:end]))
        return cls(P, slot_blocks, slot_offsets, decode_rows, decode_blocks, decode_block_seq, decode_block_idx,
                   decode_first_block, bias, prefills)


def write_kv(kv_pool: np.ndarray, layer: int, meta: AttentionMetadata, k: np.ndarray, v: np.ndarray) -> None:
    """Store new tokens' keys and values ([T, kv_heads, head_dim] each) in their pool slots."""
    kv_pool[meta.slot_blocks, layer, 0, :, meta.slot_offsets, :] = k
    kv_pool[meta.slot_blocks, layer, 1, :, meta.slot_offsets, :] = v


def paged_attention(q: np.ndarray, kv_pool: np.ndarray, layer: int, meta: AttentionMetadata,
                    scale: float) -> np.ndarray:
    """Attention of new queries over their sequences' pages. q [T, n_heads, hd] -> [T, n_heads, hd]."""
    out = np.empty_like(q)
    layer_kv = kv_pool[:, layer]  # [blocks, 2, kv_heads, P, hd] (view)
    if len(meta.decode_rows):
        out[meta.decode_rows] = _decode(q[meta.decode_rows], layer_kv, meta, scale)
    for seq in meta.prefills:
        out[seq.start:seq.end] = _prefill(q[seq.start:seq.end], layer_kv, seq, scale)
    return out


def _decode(q: np.ndarray, layer_kv: np.ndarray, meta: AttentionMetadata, scale: float) -> np.ndarray:
    # q [S, H, hd] -> [S, H, hd]; one query per sequence, contexts of different lengths.
    S, H, hd = q.shape
    _, _, KV, P, _ = layer_kv.shape
    G = H // KV
    MB = meta.decode_bias.shape[1] // P
    seq, idx = meta.decode_block_seq, meta.decode_block_idx
    kv = layer_kv[meta.decode_blocks]                      # [Nb, 2, KV, P, hd] (gather)
    k, v = kv[:, 0], kv[:, 1]                              # [Nb, KV, P, hd]
    qb = q.reshape(S, KV, G, hd)[seq]                      # [Nb, KV, G, hd]: each block's query
    block_scores = np.matmul(qb, k.swapaxes(-1, -2))       # [Nb, KV, G, P]
    scores = np.empty((S, KV, G, MB, P), dtype=q.dtype)
    if MB * S > len(seq):                                  # sequences shorter than the longest
        scores.fill(-np.inf)
    scores[seq, :, :, idx] = block_scores
    scores = scores.reshape(S, KV, G, MB * P)
    scores *= scale
    scores += meta.decode_bias[:, None, None, :]
    weights, denom = _exp_normalizer_(scores)
    probs = weights.reshape(S, KV, G, MB, P)[seq, :, :, idx]   # [Nb, KV, G, P]
    out = np.add.reduceat(np.matmul(probs, v), meta.decode_first_block, axis=0)  # [S, KV, G, hd]
    out /= denom.reshape(S, KV, G, 1)
    return out.reshape(S, H, hd)


def _prefill(q: np.ndarray, layer_kv: np.ndarray, seq: PrefillSeq, scale: float) -> np.ndarray:
    # q [n, H, hd] -> [n, H, hd]; gathers one sequence's pages into contiguous [KV, ctx, hd].
    hd = q.shape[2]
    KV = layer_kv.shape[2]
    kv = layer_kv[seq.blocks]                              # [nb, 2, KV, P, hd]
    k = kv[:, 0].transpose(1, 0, 2, 3).reshape(KV, -1, hd)[:, : seq.context_len]
    v = kv[:, 1].transpose(1, 0, 2, 3).reshape(KV, -1, hd)[:, : seq.context_len]
    return causal_attention(q, k, v, seq.positions, scale)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                     scale: float) -> np.ndarray:
    """Queries q [n, H, hd] at q_positions over one sequence's keys/values k, v [KV, ctx, hd]
    (position j at index j), causal. Used by paged prefill and by the dense runner."""
    n, H, hd = q.shape
    KV, ctx, _ = k.shape
    G = H // KV
    kt = k.transpose(0, 2, 1)                              # [KV, hd, ctx]
    out = np.empty((n, KV, G, hd), dtype=q.dtype)
    chunk = max(1, MAX_SCORE_ELEMENTS // (H * ctx))
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        m = hi - lo
        qc = q[lo:hi].reshape(m, KV, G, hd).transpose(1, 2, 0, 3).reshape(KV, G * m, hd)
        scores = np.matmul(qc, kt).reshape(KV, G, m, ctx)  # [KV, G, m, ctx]
        scores *= scale
        if q_positions[lo] < ctx - 1 or m > 1:            # some keys lie in some query's future
            scores += np.where(np.arange(ctx)[None, :] > q_positions[lo:hi, None], np.float32(-np.inf),
                               np.float32(0))              # causal mask [m, ctx]
        weights, denom = _exp_normalizer_(scores)
        o = np.matmul(weights.reshape(KV, G * m, ctx), v).reshape(KV, G, m, hd)
        o /= denom
        out[lo:hi] = o.transpose(2, 0, 1, 3)
    return out.reshape(n, H, hd)


def _exp_normalizer_(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Softmax numerators in place over the last axis, and their sums (divide after the PV matmul:
    fewer elements than dividing the probabilities)."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    return x, x.sum(axis=-1, keepdims=True)


def dense_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_positions: np.ndarray,
                    scale: float) -> np.ndarray:
    """Reference: queries [n, H, hd] at q_positions over contiguous keys/values [ctx, KV, hd]
    (position j at row j), causal. Plain and unoptimized on purpose."""
    n, H, hd = q.shape
    ctx, KV, _ = k.shape
    G = H // KV
    k = np.repeat(k, G, axis=1)                            # [ctx, H, hd]
    v = np.repeat(v, G, axis=1)
    scores = np.einsum("nhd,chd->hnc", q, k) * scale       # [H, n, ctx]
    scores = np.where(np.arange(ctx)[None, None, :] > np.asarray(q_positions)[None, :, None], -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return np.einsum("hnc,chd->nhd", probs, v).astype(q.dtype)
