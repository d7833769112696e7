"""Page size of a model, from its config alone (no weights): what kvnodes must be started with."""

from __future__ import annotations

import functools

import numpy as np

from protos.pages import DEFAULT_PAGE_TOKENS
from worker.model import read_model_config


def model_page_bytes(model: str, kv_dtype: str = "float32", page_tokens: int = DEFAULT_PAGE_TOKENS) -> int:
    """Bytes of one page [layers, 2, kv_heads, page_tokens, head_dim] of `model` in `kv_dtype`."""
    if kv_dtype not in ("float32", "float16"):
        raise ValueError(f"kv dtype must be float32 or float16, got {kv_dtype!r}")
    config = _config(model)
    return config.n_layers * 2 * config.n_kv_heads * page_tokens * config.head_dim * np.dtype(kv_dtype).itemsize


@functools.lru_cache(maxsize=8)
def _config(model: str):
    return read_model_config(model)   # a GGUF's metadata takes seconds to parse: once per process
