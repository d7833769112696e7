"""Page size of a model, from its config alone (no weights): what kvnodes must be started with."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from base.pages import DEFAULT_PAGE_TOKENS
from worker.model import KV_DTYPES, page_bytes_of, read_model_config
from worker.model.config import PRESETS, read_config
from worker.model.named import NAMED_GGUF

# What --model takes, for help texts and errors.
MODELS = (f"a named model ({', '.join(NAMED_GGUF)}), a preset with random weights ({', '.join(PRESETS)}), "
          "a .gguf file or a Hugging Face checkpoint folder (config.json + model.safetensors)")


def model_page_bytes(model: str, kv_dtype: str = "float32", page_tokens: int = DEFAULT_PAGE_TOKENS) -> int:
    """Bytes of one page of `model` in `kv_dtype` (worker.model.page_bytes_of), its config read alone."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    return page_bytes_of(_config(model), kv_dtype, page_tokens)


def model_max_positions(model: str) -> int:
    """The most positions (prompt and answer) `model` takes, its config read alone."""
    return _config(model).max_positions


@functools.lru_cache(maxsize=8)
def _config(model: str):
    check_model_name(model)
    return read_model_config(model)   # a GGUF's metadata takes seconds to parse: once per process


def check_model_name(model: str) -> None:
    """ValueError listing the models that work, for a name that is none of them (the folder
    reader's own "no config.json in NAME" would hide that NAME was meant as a model's name)."""
    if model in NAMED_GGUF or model in PRESETS:
        return
    path = Path(model)
    if path.suffix.lower() == ".gguf" and not path.is_file():
        raise ValueError(f"model {model!r}: no such .gguf file. --model takes {MODELS}")
    if path.suffix.lower() != ".gguf" and not (path / "config.json").is_file():
        what = "a folder without config.json" if path.is_dir() else "no such model or folder"
        raise ValueError(f"model {model!r}: {what}. --model takes {MODELS}")


# vLLM's KV cache dtypes we size pages for, in bytes an element.
VLLM_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
VLLM_CPU_BLOCK_SIZE = 128   # the block size vLLM's CPU backend picks when none is given


@dataclass(frozen=True)
class VllmBlockPages:
    """How a vLLM engine's blocks land on kvnodes: the vLLM connector stores one layer of one
    block as one page (vllm_connector/keys.py), so a block is `layers` pages of `page_bytes`."""

    page_bytes: int
    layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    def describe(self) -> str:
        """The product that gives page_bytes, so a user can check it against vLLM's own log."""
        return (f"2 (K and V) x {self.block_size} tokens x {self.kv_heads} KV heads x {self.head_dim} head_dim x "
                f"{VLLM_DTYPE_BYTES[self.dtype]} bytes ({self.dtype})")


def vllm_block_pages(folder: str | Path, block_size: int = VLLM_CPU_BLOCK_SIZE,
                     dtype: str = "bfloat16") -> VllmBlockPages:
    """vLLM's page of one layer (AttentionSpec.page_size_bytes) for the Hugging Face model in `folder`,
    from its config.json alone; ValueError (CheckpointError) for a folder our reader refuses."""
    if dtype not in VLLM_DTYPE_BYTES:
        raise ValueError(f"vLLM dtype must be one of {', '.join(VLLM_DTYPE_BYTES)}, got {dtype!r}")
    if block_size < 1:
        raise ValueError(f"vLLM block size must be at least 1, got {block_size}")
    config = read_config(folder)
    page_bytes = 2 * block_size * config.n_kv_heads * config.head_dim * VLLM_DTYPE_BYTES[dtype]
    return VllmBlockPages(page_bytes, config.n_layers, block_size, config.n_kv_heads, config.head_dim, dtype)
