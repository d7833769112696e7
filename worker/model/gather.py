"""Gather plans: which rows of the KV pool attention copies for a set of sequences, and the copy.

A gather copies a sequence's pages head-major into a scratch buffer the forward reuses, and
converts them to float32 on the way: a float16 pool through worker/kv/half.py, an int8 or int4
pool through its codec (worker/kv/quant.py). attention.py builds the plans (AttentionMetadata.build)
and reads what they gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.kv.half import float16_to_float32

KEYS, VALUES, KEYS_AND_VALUES = slice(0, 1), slice(1, 2), slice(0, 2)


@dataclass
class GatherPlan:
    """Which pool rows to copy for a set of sequences, padded to [S, 2, KV, max_blocks].

    A gather copies a sequence's pages head-major, [kv_heads, blocks * P, head_dim]: with the page
    layout fixed by the wire (docs/architecture.md), a head's keys in two consecutive blocks are a
    whole page apart, so even consecutive blocks are no matmul operand without this copy."""

    rows: np.ndarray        # [S, 2, KV, MB] row of (block, layer 0, k|v, head) in the pool seen as [rows, P*hd]
    layer_stride: int       # add layer * layer_stride for another layer
    byte_rows: np.ndarray | None = None   # [S, KV, MB] row of (block, layer 0, head) of a quantized pool

    def gather(self, kv_pool: np.ndarray, layer: int, meta,
               parts: slice = KEYS_AND_VALUES) -> np.ndarray:
        """-> [S, len(parts), KV, MB * P, hd] (in the forward's scratch buffer, overwritten by the next gather).
        `meta` is the forward's AttentionMetadata: its scratch buffers and the pool's codec."""
        if meta.codec is not None:
            return self._gather_quantized(kv_pool, layer, meta, parts)
        rows = self.rows[:, parts]
        S, n_parts, KV, MB = rows.shape
        P, hd = kv_pool.shape[4], kv_pool.shape[5]
        n = rows.size
        # One np.take into a scratch buffer every layer of the forward reuses: fresh memory each
        # layer cost more than the copy itself here.
        if meta.scratch is None or meta.scratch.shape[0] < n:
            meta.scratch = np.empty((meta.max_gather_rows, P * hd), dtype=np.float32)
        out = meta.scratch[:n]
        taken = out
        # A float16 pool is taken into a float16 scratch (half the bytes read), then converted by
        # worker/kv/half.py: NumPy's matmul has no fast float16 path and its own cast runs element by
        # element. The conversion is exact: the scores are those of a float32 pool of the same values.
        if kv_pool.dtype == np.float16:
            if meta.half_scratch is None or meta.half_scratch.shape[0] < n:
                meta.half_scratch = np.empty((meta.max_gather_rows, P * hd), dtype=np.float16)
            taken = meta.half_scratch[:n]
        # mode="clip" skips take's defensive copy (block ids were validated by the caller).
        np.take(kv_pool.reshape(-1, P * hd), (rows + layer * self.layer_stride).reshape(-1), axis=0,
                out=taken, mode="clip")
        if taken is not out:
            float16_to_float32(taken, out)
        return out.reshape(S, n_parts, KV, MB * P, hd)

    def _gather_quantized(self, kv_pool: np.ndarray, layer: int, meta, parts: slice) -> np.ndarray:
        """An int8 or int4 pool (worker/kv/quant.py) is bytes [blocks, layer, kv_head, token, K then V
        bytes]: its (block, layer, head) rows, mapped from the plan's float-layout rows, are taken
        once for a plan's keys and values into a byte scratch and decoded into the float32 one."""
        codec = meta.codec
        S, n_parts, KV, MB = self.rows[:, parts].shape
        P, token_bytes, hd = kv_pool.shape[3], kv_pool.shape[4], codec.head_dim
        if self.byte_rows is None:
            first = self.rows[:, 0]
            self.byte_rows = (first // (2 * KV)) * KV + first % KV
        n, m = S * n_parts * KV * MB, S * KV * MB
        if meta.scratch is None or meta.scratch.shape[0] < n:
            meta.scratch = np.empty((meta.max_gather_rows, P * hd), dtype=np.float32)
        if meta.byte_scratch is None or meta.byte_scratch.shape[0] < m:
            meta.byte_scratch = np.empty((meta.max_gather_rows // 2, P * token_bytes), dtype=np.uint8)
        taken = meta.byte_scratch[:m]
        if meta.bytes_taken != (id(self), layer):
            np.take(kv_pool.reshape(-1, P * token_bytes), (self.byte_rows + layer * KV).reshape(-1), axis=0,
                    out=taken, mode="clip")
            meta.bytes_taken = (id(self), layer)
        out = meta.scratch[:n].reshape(S, n_parts, KV * MB * P, hd)
        tokens = taken.reshape(S, KV * MB * P, token_bytes)
        decoders = [codec.decode_keys, codec.decode_values][parts]
        for i, decode in enumerate(decoders):
            if n_parts == 1:
                decode(tokens.reshape(-1, token_bytes), out.reshape(-1, hd))
                continue
            for s in range(S):
                decode(tokens[s], out[s, i])
        return out.reshape(S, n_parts, KV, MB * P, hd)


def gather_plan(tables: list[np.ndarray], first_blocks: list[int], n_blocks: list[int],
                pool_shape: tuple[int, ...], readable: list[int] | None = None) -> GatherPlan:
    """Rows of blocks table[first:n] of each sequence, padded to the longest run. Blocks before
    readable[i] (a window's, see AttentionMetadata.build) are read as that one: their keys
    are hidden."""
    _, n_layers, _, KV, _, _ = pool_shape
    MB = max(n - f for f, n in zip(first_blocks, n_blocks))
    padded = np.empty((len(tables), MB), dtype=np.int64)
    for i, (table, first, nb) in enumerate(zip(tables, first_blocks, n_blocks)):
        padded[i, : nb - first] = table[first:nb]
        padded[i, nb - first:] = table[first]
        if readable is not None and readable[i] > first:
            padded[i, : readable[i] - first] = table[readable[i]]
    kv_and_head = (np.arange(2)[:, None] * KV + np.arange(KV)[None, :])          # [2, KV]
    rows = (padded[:, None, None, :] * n_layers) * (2 * KV) + kv_and_head[None, :, :, None]
    return GatherPlan(rows, 2 * KV)
