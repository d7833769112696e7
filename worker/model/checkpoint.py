"""Load a Hugging Face checkpoint folder: config.json + model.safetensors (or a sharded
model.safetensors.index.json), through the safetensors NumPy API, into float32 arrays under
canonical names (no `transformer.` / `model.` prefix). Anything we cannot run exactly is refused
with a CheckpointError that names the file, tensor, key or shape at fault.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from . import gpt2, llama
from .config import CheckpointError, ModelConfig, read_config

ARCH_MODULES = {"gpt2": gpt2, "llama": llama}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def load_checkpoint(folder: str | Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """-> (config, {canonical name: float32 array}) in the order of the family's tensor list."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory")
    config = read_config(folder)
    arch = ARCH_MODULES[config.arch]
    tensors = _canonical_names(read_tensors(weight_files(folder)), arch, config)
    if config.tie_word_embeddings is None:   # config silent: an lm_head in the files means untied
        config = dataclasses.replace(config, tie_word_embeddings="lm_head.weight" not in tensors)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # a tied head saved anyway is the embedding itself
    expected = arch.tensor_shapes(config)
    missing = [name for name in expected if name not in tensors]
    if missing:
        name = missing[0]
        where = "" if name == "lm_head.weight" else f" (looked for it with and without the {arch.PREFIX!r} prefix)"
        more = f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: missing tensor {name!r} for {config.describe()}{where}{more}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{folder}: unexpected tensor {unexpected[0]!r} (not part of a {config.describe()} "
                              f"model with this config; {len(unexpected)} such tensor(s))")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise CheckpointError(f"{folder}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                                  f"expected {list(shape)} from config.json")
    return config, {name: tensors[name] for name in expected}


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: the single file, or every shard the index names."""
    single, index = folder / SINGLE_FILE, folder / INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: 'weight_map' should be a non-empty object")
    files = []
    for name in sorted(set(weight_map.values())):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{index}: shard file {name!r} is missing from {folder}")
        files.append(path)
    return files


def read_tensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor of the files as float32 (bf16/fp16 widened exactly)."""
    tensors: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for name in f.keys():
                    if name in tensors:
                        raise CheckpointError(f"{path}: tensor {name!r} appears in more than one file")
                    dtype = f.get_slice(name).get_dtype()
                    if dtype not in FLOAT_DTYPES:
                        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; "
                                              f"expected one of {sorted(FLOAT_DTYPES)}")
                    if dtype == "BF16":   # NumPy has no bfloat16: widen the raw bits
                        tensors[name] = _read_bf16(path, name)
                    else:
                        tensors[name] = f.get_tensor(name).astype(np.float32, copy=False)
        except SafetensorError as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    return tensors


def _read_bf16(path: Path, name: str) -> np.ndarray:
    # safetensors layout: u64 little-endian header length, JSON header, then the data section.
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(header_len))[name]
    start, end = entry["data_offsets"]
    bits = np.fromfile(path, dtype="<u2", count=(end - start) // 2, offset=8 + header_len + start)
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"])


def _canonical_names(raw: dict[str, np.ndarray], arch, config: ModelConfig) -> dict[str, np.ndarray]:
    tensors = {}
    for name, t in raw.items():
        if name.endswith(arch.IGNORED_SUFFIXES):
            continue
        canonical = name[len(arch.PREFIX):] if name.startswith(arch.PREFIX) else name
        if canonical in tensors:
            raise CheckpointError(f"tensor {canonical!r} appears both with and without the {arch.PREFIX!r} prefix")
        tensors[canonical] = t
    return tensors
