"""The model layer: load a model (preset or HF folder) and run it over the worker's paged KV pool.

Public surface: load_model, Model, ForwardBatch, ModelConfig, CheckpointError.
"""

from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from base.pages import KV_DTYPES  # int8 and int4: worker/kv/quant.py
from .attention import AttentionMetadata, paged_attention, write_kv
from ..kv.quant import kv_codec, token_bytes
from ..kv.window import first_read_block
from .blas import attention_threads, threads_for_rows
from .chat import ChatError, ChatTemplate, folder_chat_template
from .checkpoint import ARCH_MODULES, load_checkpoint
from .config import PRESET_SEEDS, PRESETS, CheckpointError, ModelConfig, read_config
from .gguf_file import read_gguf
from .init import random_tensors
from .invariant import InvariantUnavailable
from .invariant_check import verify_invariant
from .named import NAMED_GGUF, named_gguf_path
from .layers import Attend, BetweenLayers, round_kv
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger("worker.model")

__all__ = ["load_model", "load_model_tensors", "load_model_tokenizer", "read_model_config", "Model", "ForwardBatch",
           "ModelConfig", "CheckpointError", "ChatError", "KV_DTYPES", "page_bytes_of", "kv_block_shape",
           "kv_token_bytes"]

# Batch- and chunk-invariant numerics unless a model is loaded with invariant=False
# (worker/model/invariant.py; README, "Numerics").
DEFAULT_INVARIANT = True


@dataclass
class ForwardBatch:
    token_ids: np.ndarray       # int64 [T]: new tokens of all sequences, concatenated in sequence order
    positions: np.ndarray       # int64 [T]: absolute position of each new token in its sequence
    query_starts: np.ndarray    # int64 [S+1]: sequence s's new tokens are token_ids[query_starts[s]:query_starts[s+1]]
    context_lens: np.ndarray    # int64 [S]: tokens of sequence s after this step (cached + new)
    # per sequence: block i holds positions [iP, (i+1)P); with a sliding window, entries before
    # the first block its queries see are not read (worker/kv/window.py: RELEASED there)
    block_tables: list[np.ndarray] = field(default_factory=list)
    all_logits: bool = False    # False: [S, vocab] at each sequence's last new token; True: [T, vocab]
    # int64 [S] or None: sequence s's positions below cached_lens[s] hold their K/V in a cached page
    # (shared, indexed): computed again for their queries, never written (Scheduler._admit)
    cached_lens: np.ndarray | None = None


class Model:
    def __init__(self, name: str, config: ModelConfig, tensors: dict[str, np.ndarray], tokenizer: Tokenizer,
                 chat_template: ChatTemplate | None = None, invariant: bool | None = None):
        """`invariant`: a row's logits and K/V do not depend on its batch or chunking
        (worker/model/invariant.py); None takes DEFAULT_INVARIANT. Where the BLAS here cannot give
        it, the model says so in the log and runs without (`self.invariant` False)."""
        self.name = name
        self.config = config
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.weights_digest = weights_digest(tensors)
        self.arch = ARCH_MODULES[config.arch]
        self.invariant = DEFAULT_INVARIANT if invariant is None else bool(invariant)
        if self.invariant:
            try:
                verify_invariant(config)
            except InvariantUnavailable as exc:
                log.warning("model %s runs without invariant numerics: %s", name, exc)
                self.invariant = False
        self.params = self.arch.build_params(tensors, config, self.invariant)
        self.attn_scale = 1.0 / math.sqrt(config.head_dim)   # a Python float (see layers.py)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.name!r}, {c.describe()}, layers={c.n_layers}, d={c.d_model}, "
                f"heads={c.n_heads}/{c.n_kv_heads}{', invariant' if self.invariant else ''})")

    def fingerprint(self, kv_dtype: str, page_tokens: int) -> bytes:
        """16 bytes that stand in for the parent key of a sequence's first page (docs/architecture.md):
        equal only for the same architecture, config, weights, KV dtype, page size and numerics
        (pages computed with invariant numerics are kept apart from the others')."""
        _check_kv_dtype(kv_dtype)
        h = hashlib.blake2b(digest_size=16)
        numerics = (b"invariant-v1",) if self.invariant else ()
        for part in (b"kvcache-model-v1", self.config.to_json().encode(), self.weights_digest,
                     kv_dtype.encode(), str(int(page_tokens)).encode(), *numerics):
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        return h.digest()

    def chat_token_ids(self, messages) -> list[int]:
        """The prompt of a chat: the model's template rendered (with the assistant's turn opened),
        then tokenized without adding special tokens (the template writes them)."""
        if self.chat_template is None:
            raise ChatError(f"model {self.name!r} has no chat template: send a prompt instead of messages")
        return list(self.tokenizer.encode(self.chat_template.render(messages), add_special_tokens=False))

    def page_bytes(self, kv_dtype: str, page_tokens: int) -> int:
        return page_bytes_of(self.config, kv_dtype, page_tokens)

    def run(self, token_ids: np.ndarray, positions: np.ndarray, attend: Attend,
            head_rows: np.ndarray | None = None, between_layers: BetweenLayers | None = None) -> np.ndarray:
        """The family's forward with any KV storage (`attend`); logits at head_rows (None = all)."""
        with threads_for_rows(len(token_ids), self.invariant):
            return self.arch.forward(self.params, self.config, token_ids, positions, attend, head_rows, between_layers)

    def forward(self, batch: ForwardBatch, kv_pool: np.ndarray, kv_dtype: str = "float32",
                between_layers: BetweenLayers | None = None) -> np.ndarray:
        """Compute the batch's new tokens over the paged pool, writing their K/V into it.
        -> [S, vocab] (last new token of each sequence) or [T, vocab] with all_logits.
        The pool is float32, or float16 with float16 KV (the same rounded values, half the memory),
        or bytes [blocks, layers, kv_heads, page_tokens, token bytes] with int8 or int4 KV (worker/kv/quant.py).
        `between_layers()` runs after each layer but the last; it may run other forwards over
        other blocks of the pool (none of this batch's)."""
        _check_kv_dtype(kv_dtype)
        token_ids, positions, query_starts, context_lens = _validate(self.config, batch, kv_pool, kv_dtype)
        codec = kv_codec(kv_dtype, self.config.head_dim)
        shape = kv_pool.shape if codec is None else logical_pool_shape(self.config, kv_pool)
        meta = AttentionMetadata.build(positions, query_starts, context_lens, batch.block_tables, shape,
                                       window=self.config.sliding_window, cached_lens=batch.cached_lens,
                                       invariant=self.invariant)
        meta.codec = codec
        scale = self.attn_scale

        # a float16 pool rounds as it stores, a quantized one encodes (write_kv)
        rounding = kv_dtype if kv_pool.dtype == np.float32 else "float32"

        def attend(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            write_kv(kv_pool, layer, meta, round_kv(k, rounding), round_kv(v, rounding, "v"))
            with attention_threads(len(token_ids), self.invariant):
                return paged_attention(q, kv_pool, layer, meta, scale)

        head_rows = None if batch.all_logits else query_starts[1:] - 1
        return self.run(token_ids, positions, attend, head_rows, between_layers)


def load_model(name_or_path: str, invariant: bool | None = None) -> Model:
    """A preset ("tiny", "gpt2-small-shape"), a named model ("smollm2-135m"), a GGUF file or a
    Hugging Face checkpoint folder; `invariant` as for Model."""
    if name_or_path in PRESETS:
        config = PRESETS[name_or_path]
        tensors = _preset_tensors(name_or_path)
        return Model(name_or_path, config, tensors, ByteTokenizer(config.eos_token_id), invariant=invariant)
    gguf_path = _gguf_path(name_or_path)
    if gguf_path is not None:
        return _load_gguf(gguf_path, name_or_path if name_or_path in NAMED_GGUF else gguf_path.stem, invariant)
    folder = _checkpoint_folder(name_or_path)
    config, tensors = load_checkpoint(folder)
    tokenizer = load_tokenizer(folder, config.eos_token_id, config.vocab_size)
    return Model(folder.name or str(folder), config, tensors, tokenizer, folder_chat_template(folder), invariant)


def load_model_tensors(name_or_path: str) -> dict[str, np.ndarray]:
    """The weights load_model would give this name, found by the same rules, without building a
    model: for another runtime to run the same weights."""
    if name_or_path in PRESETS:
        return _preset_tensors(name_or_path)
    gguf_path = _gguf_path(name_or_path)
    if gguf_path is not None:
        return read_gguf(gguf_path).tensors
    return load_checkpoint(_checkpoint_folder(name_or_path))[1]


def read_model_config(name_or_path: str) -> ModelConfig:
    """The config of a preset, named model, GGUF file or checkpoint folder, without its weights."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    gguf_path = _gguf_path(name_or_path)
    if gguf_path is not None:
        return read_gguf(gguf_path, with_tensors=False).config
    return read_config(name_or_path)


def _preset_tensors(name: str) -> dict[str, np.ndarray]:
    config = PRESETS[name]
    return random_tensors(ARCH_MODULES[config.arch].tensor_shapes(config), config, PRESET_SEEDS[name])


def _checkpoint_folder(name_or_path: str) -> Path:
    folder = Path(name_or_path)
    if not folder.exists():
        raise CheckpointError(f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}), a named model "
                              f"({', '.join(NAMED_GGUF)}), a .gguf file nor an existing folder")
    return folder


def _gguf_path(name_or_path: str) -> Path | None:
    if name_or_path in NAMED_GGUF:
        return named_gguf_path(name_or_path)
    path = Path(name_or_path)
    return path if path.suffix.lower() == ".gguf" else None


def _load_gguf(path: Path, name: str, invariant: bool | None = None) -> Model:
    g = read_gguf(path)
    tokenizer = HFTokenizer(g.tokenizer, g.config.eos_token_id)
    template = None
    if g.chat_template:
        bos = g.tokenizer.id_to_token(g.bos_token_id) if g.bos_token_id is not None else None
        template = ChatTemplate(g.chat_template, bos or "", g.tokenizer.id_to_token(g.config.eos_token_id) or "")
    return Model(name, g.config, g.tensors, tokenizer, template, invariant)


def load_model_tokenizer(name_or_path: str) -> Tokenizer:
    """The tokenizer of a preset, named model, GGUF file or checkpoint folder, without its weights
    (for clients that send token ids)."""
    if name_or_path in PRESETS:
        return ByteTokenizer(PRESETS[name_or_path].eos_token_id)
    gguf_path = _gguf_path(name_or_path)
    if gguf_path is not None:
        g = read_gguf(gguf_path, with_tensors=False)
        return HFTokenizer(g.tokenizer, g.config.eos_token_id)
    config = read_config(name_or_path)
    return load_tokenizer(name_or_path, config.eos_token_id, config.vocab_size)


def weights_digest(tensors: dict[str, np.ndarray]) -> bytes:
    """BLAKE2b over every weight's name, dtype, shape and bytes, in name order."""
    h = hashlib.blake2b(digest_size=32)
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"{name}\0{t.dtype.str}\0{list(t.shape)}\0".encode())
        h.update(memoryview(t).cast("B"))
    return h.digest()


def page_bytes_of(c: ModelConfig, kv_dtype: str, page_tokens: int) -> int:
    """Bytes of one page [layers, 2 (k, v), kv_heads, page_tokens, head_dim] in `kv_dtype` (int8 and
    int4: [layers, kv_heads, page_tokens, token bytes]), from the config alone: what a worker writes
    and its kvnodes must be started with."""
    return c.n_layers * c.n_kv_heads * page_tokens * kv_token_bytes(c, kv_dtype)


def kv_token_bytes(c: ModelConfig, kv_dtype: str) -> int:
    """Bytes of one token's K and V of one head in `kv_dtype`, scales included."""
    return token_bytes(_check_kv_dtype(kv_dtype), c.head_dim)


def kv_block_shape(c: ModelConfig, kv_dtype: str, page_tokens: int) -> tuple[int, ...]:
    """The shape of one block of a pool in `kv_dtype` (its dtype: worker.kv.quant.storage_dtype)."""
    if kv_codec(_check_kv_dtype(kv_dtype), c.head_dim) is None:
        return (c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim)
    return (c.n_layers, c.n_kv_heads, page_tokens, kv_token_bytes(c, kv_dtype))


def logical_pool_shape(c: ModelConfig, kv_pool: np.ndarray) -> tuple[int, ...]:
    """A quantized pool's shape as attention plans it: that of a float pool of as many blocks."""
    return (kv_pool.shape[0], c.n_layers, 2, c.n_kv_heads, kv_pool.shape[3], c.head_dim)


def _check_kv_dtype(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return kv_dtype


def _validate(c: ModelConfig, batch: ForwardBatch, kv_pool: np.ndarray, kv_dtype: str):
    """Refuse a malformed batch with a ValueError before anything is written to the pool."""
    if kv_dtype in ("float32", "float16"):
        expected_pool = (c.n_layers, 2, c.n_kv_heads, None, c.head_dim)
        dtypes = ("float32", "float16") if kv_dtype == "float16" else ("float32",)   # no float32 KV in a float16 pool
        described = f"[blocks, {c.n_layers}, 2, {c.n_kv_heads}, page_tokens, {c.head_dim}]"
    else:
        expected_pool = (c.n_layers, c.n_kv_heads, None, kv_token_bytes(c, kv_dtype))
        dtypes = ("uint8",)
        described = f"[blocks, {c.n_layers}, {c.n_kv_heads}, page_tokens, {expected_pool[-1]}]"
    if (kv_pool.dtype.name not in dtypes or kv_pool.ndim != len(expected_pool) + 1 or not kv_pool.flags.c_contiguous
            or any(e is not None and e != g for e, g in zip(expected_pool, kv_pool.shape[1:]))):
        raise ValueError(f"kv_pool should be C-ordered {' or '.join(dtypes)} {described} for {kv_dtype} KV, "
                         f"got {kv_pool.dtype} {list(kv_pool.shape)}")
    num_blocks, page_tokens = kv_pool.shape[0], kv_pool.shape[-2]
    token_ids = np.asarray(batch.token_ids, dtype=np.int64).reshape(-1)
    positions = np.asarray(batch.positions, dtype=np.int64).reshape(-1)
    query_starts = np.asarray(batch.query_starts, dtype=np.int64).reshape(-1)
    context_lens = np.asarray(batch.context_lens, dtype=np.int64).reshape(-1)
    T, S = len(token_ids), len(context_lens)
    if T == 0 or len(positions) != T:
        raise ValueError(f"batch has {T} token ids and {len(positions)} positions (need the same, at least one)")
    if len(query_starts) != S + 1 or len(batch.block_tables) != S:
        raise ValueError(f"batch of {S} sequences needs {S + 1} query_starts and {S} block tables, "
                         f"got {len(query_starts)} and {len(batch.block_tables)}")
    counts = np.diff(query_starts)
    if query_starts[0] != 0 or query_starts[-1] != T or (counts < 1).any():
        raise ValueError(f"query_starts {query_starts.tolist()} should rise from 0 to {T}, "
                         f"at least one new token per sequence")
    if token_ids.min() < 0 or token_ids.max() >= c.vocab_size:
        raise ValueError(f"token ids should be in [0, {c.vocab_size}), got {token_ids.min()}..{token_ids.max()}")
    if positions.min() < 0:
        raise ValueError(f"positions should be >= 0, got {positions.min()}")
    if positions.max() >= c.max_positions:
        raise ValueError(f"position {positions.max()} is beyond the model's {c.max_positions} positions")
    ends = np.repeat(context_lens, counts)                  # each token's context_len
    offsets = np.arange(T) - np.repeat(query_starts[1:], counts)   # -n..-1 within its sequence
    if not np.array_equal(positions, ends + offsets):
        raise ValueError("positions should be each sequence's new tokens, contiguous and ending at context_len - 1")
    for s, table in enumerate(batch.block_tables):
        needed = -(-int(context_lens[s]) // page_tokens)
        first = first_read_block(int(positions[query_starts[s]]), c.sliding_window, page_tokens)  # what is read
        table = np.asarray(table)
        read = table[first:needed]
        if len(table) < needed or (len(read) and (read.min() < 0 or read.max() >= num_blocks)):
            raise ValueError(f"sequence {s}: block table needs {needed} ids for {int(context_lens[s])} tokens, "
                             f"those from entry {first} on in [0, {num_blocks}), got {table[:needed].tolist()}")
    return token_ids, positions, query_starts, context_lens
