"""Unpaged baselines with the same math as the paged forward.

DenseRunner keeps each sequence's K/V in contiguous per-sequence arrays (what an inference loop
without paging does): the benchmark's reference for paged decode and prefill speed.
reference_logits recomputes a whole sequence with no cache at all: the tests' ground truth.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention import causal_attention, dense_attention
from . import Model
from .blas import single_thread
from .layers import round_kv


@dataclass
class DenseState:
    k: np.ndarray     # [layers, kv_heads, capacity, head_dim]
    v: np.ndarray
    length: int       # tokens stored

    def reserve(self, n: int) -> None:
        """Room for n more tokens (capacity doubles, so appends are amortized O(1))."""
        cap = self.k.shape[2]
        if self.length + n <= cap:
            return
        new_cap = max(2 * cap, self.length + n)
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = np.zeros(old.shape[:2] + (new_cap,) + old.shape[3:], dtype=np.float32)
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)


class DenseRunner:
    def __init__(self, model: Model, kv_dtype: str = "float32"):
        self.model = model
        self.kv_dtype = kv_dtype
        model.page_bytes(kv_dtype, 1)   # validates kv_dtype

    def new_state(self, capacity: int) -> DenseState:
        c = self.model.config
        shape = (c.n_layers, c.n_kv_heads, max(1, capacity), c.head_dim)
        return DenseState(np.zeros(shape, np.float32), np.zeros(shape, np.float32), 0)

    def prefill(self, token_ids) -> tuple[np.ndarray, DenseState]:
        """A whole prompt -> (logits at its last token [vocab], state)."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        state = self.new_state(2 * len(ids))
        positions = np.arange(len(ids))
        self._check_positions(positions)
        scale, kv_dtype = self.model.attn_scale, self.kv_dtype

        def attend(layer, q, k, v):
            n = len(q)
            state.k[layer, :, :n] = round_kv(k, kv_dtype).transpose(1, 0, 2)
            state.v[layer, :, :n] = round_kv(v, kv_dtype, "v").transpose(1, 0, 2)
            with single_thread():   # as the paged forward's attention (blas.py)
                return causal_attention(q, state.k[layer, :, :n], state.v[layer, :, :n], positions, scale,
                                        self.model.config.sliding_window)

        logits = self.model.run(ids, positions, attend, head_rows=np.array([len(ids) - 1]))
        state.length = len(ids)
        return logits[0], state

    def decode(self, states: list[DenseState], tokens) -> np.ndarray:
        """One new token per sequence -> logits [B, vocab]; each state grows by one."""
        ids = np.asarray(tokens, dtype=np.int64)
        positions = np.array([s.length for s in states], dtype=np.int64)
        self._check_positions(positions)
        for s in states:
            s.reserve(1)
        scale, kv_dtype = self.model.attn_scale, self.kv_dtype
        G = self.model.config.n_heads // self.model.config.n_kv_heads
        window = self.model.config.sliding_window

        def attend(layer, q, k, v):
            k, v = round_kv(k, kv_dtype), round_kv(v, kv_dtype, "v")
            B, H, hd = q.shape
            out = np.empty_like(q)
            for i, s in enumerate(states):   # (already on one BLAS thread: decode rows are few)
                n = s.length + 1
                lo = 0 if window is None else max(0, n - window)   # sliding window: the last `window` keys
                s.k[layer, :, s.length] = k[i]
                s.v[layer, :, s.length] = v[i]
                scores = (q[i].reshape(-1, G, hd) * scale) @ s.k[layer, :, lo:n].transpose(0, 2, 1)   # [KV, G, n - lo]
                scores -= scores.max(axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                o = scores @ s.v[layer, :, lo:n]                                          # [KV, G, hd]
                o /= scores.sum(axis=-1, keepdims=True)
                out[i] = o.reshape(H, hd)
            return out

        logits = self.model.run(ids, positions, attend)
        for s in states:
            s.length += 1
        return logits

    def _check_positions(self, positions: np.ndarray) -> None:
        limit = self.model.config.max_positions
        if len(positions) and positions.max() >= limit:
            raise ValueError(f"position {positions.max()} is beyond the model's {limit} positions")


def reference_logits(model: Model, token_ids, kv_dtype: str = "float32") -> np.ndarray:
    """Logits at every position of token_ids [T] -> [T, vocab], recomputed from scratch."""
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.arange(len(ids))
    if len(ids) > model.config.max_positions:
        raise ValueError(f"{len(ids)} tokens exceed the model's {model.config.max_positions} positions")

    def attend(layer, q, k, v):
        return dense_attention(q, round_kv(k, kv_dtype), round_kv(v, kv_dtype, "v"), positions, model.attn_scale,
                               model.config.sliding_window)

    return model.run(ids, positions, attend)
