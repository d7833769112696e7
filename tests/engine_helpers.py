"""A toy model for engine tests: it follows the model interface (K/V written into the pool, then
read back from the pool for attention), computes each token on its own (so results are
bit-identical whatever the batch), and adds a chaotic term over all cached values to its logits:
any wrong, stale or missing K/V in the pool changes the tokens."""

import hashlib
from dataclasses import dataclass

import numpy as np

from worker.engine.engine import Engine
from worker.model.tokenizer import ByteTokenizer

P = 8


@dataclass
class ToyConfig:
    vocab_size: int = 257
    n_layers: int = 2
    n_kv_heads: int = 2
    head_dim: int = 4
    max_positions: int = 160
    eos_token_id: int = 256
    extra_eos_token_ids: tuple = ()

    def layer_windows(self):
        return [None] * self.n_layers


class ToyModel:
    name = "toy"

    def __init__(self, seed=0):
        self.config = cfg = ToyConfig()
        self.tokenizer = ByteTokenizer()
        rng = np.random.default_rng(seed)
        shape = (cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
        self.k_emb, self.v_emb, self.q_emb = (rng.standard_normal((cfg.vocab_size, *shape)) for _ in range(3))
        self.pos_emb = rng.standard_normal((cfg.max_positions, *shape)) * 0.5
        self.w_out = rng.standard_normal((int(np.prod(shape)), cfg.vocab_size))
        self.w_chaos = rng.standard_normal((int(np.prod(shape)), cfg.vocab_size))
        self.bias = np.where((np.arange(cfg.vocab_size) >= 97) & (np.arange(cfg.vocab_size) <= 122), 0.0, -1e4)
        self.forward_calls = []

    def fingerprint(self, kv_dtype, page_tokens):
        return hashlib.blake2b(f"toy/{kv_dtype}/{page_tokens}".encode(), digest_size=16).digest()

    def forward(self, batch, kv_pool, kv_dtype="float32", between_layers=None):
        self.forward_calls.append(batch)
        if between_layers is not None:
            between_layers()  # one pause, before any row: the engine cannot tell where it is
        rows = []
        for s in range(len(batch.block_tables)):
            table = batch.block_tables[s]
            start, end = batch.query_starts[s], batch.query_starts[s + 1]
            assert batch.positions[end - 1] == batch.context_lens[s] - 1
            for t in range(start, end):
                tok, pos = int(batch.token_ids[t]), int(batch.positions[t])
                if pos >= self.config.max_positions:
                    raise ValueError(f"position {pos} >= max positions")
                k, v = self.k_emb[tok] + self.pos_emb[pos], self.v_emb[tok] - self.pos_emb[pos]
                if kv_dtype == "float16":
                    k, v = (x.astype(np.float16).astype(np.float32) for x in (k, v))
                kv_pool[table[pos // P], :, 0, :, pos % P, :] = k
                kv_pool[table[pos // P], :, 1, :, pos % P, :] = v
                ctx = np.arange(pos + 1)
                keys = kv_pool[table[ctx // P], :, 0, :, ctx % P, :].astype(np.float64)  # [ctx, L, H, D]
                values = kv_pool[table[ctx // P], :, 1, :, ctx % P, :].astype(np.float64)
                scores = np.einsum("lhd,plhd->plh", self.q_emb[tok], keys)
                weights = np.exp(scores - scores.max(axis=0))
                weights /= weights.sum(axis=0)
                attended = np.einsum("plh,plhd->lhd", weights, values).reshape(-1)
                chaos = np.sin(1e4 * values.sum(axis=0).reshape(-1))
                rows.append(attended @ self.w_out + 3.0 * chaos @ self.w_chaos + self.bias)
        logits = np.asarray(rows, dtype=np.float32)
        if batch.all_logits:
            return logits
        return logits[np.asarray(batch.query_starts[1:]) - 1 - np.asarray(batch.query_starts[0])]


def make_engine(num_blocks=64, budget=256, max_seqs=8, tier=None, kv_dtype="float32", **kw):
    return Engine(ToyModel(), kv_dtype=kv_dtype, num_blocks=num_blocks, page_tokens=P, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, remote_tier=tier, seed=0, **kw)


PROMPTS = ["the quick brown fox jumps over the lazy dog", "hello", "a" * 37, "paged attention over a pool of blocks!"]


def alone(prompt, **params):
    return make_engine().generate([prompt], **params)[0]
