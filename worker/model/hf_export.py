"""Write a Llama-family model (a named model or a GGUF file) as a Hugging Face folder that vLLM and
transformers load: config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
generation_config.json. The weights are written as float32, the values kvcache runs bit for bit
(a dequantized GGUF weight need not fit float16 or bfloat16)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import numpy as np

from .config import PRESETS, CheckpointError, ModelConfig, read_config
from .gguf_file import GGUFModel, read_gguf
from .llama import PREFIX
from .named import NAMED_GGUF, named_gguf_path

EXPORTABLE = f"export-hf writes Llama-family models: a named model ({', '.join(NAMED_GGUF)}) or a .gguf file"


def export_hf_folder(name_or_path: str, out_dir, force: bool = False) -> Path:
    """Write the model into out_dir, built in a hidden sibling folder and renamed at the end, so an
    interrupted export never leaves a folder that looks whole. -> out_dir"""
    out = Path(os.path.abspath(out_dir))   # "." and "x/.." have names to build a sibling from
    _check_target(out, force)
    model = read_gguf(_source_gguf(name_or_path))
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    partial.mkdir()   # not mkdtemp: its 0700 would hide the model from a server running as another user
    try:
        _write_folder(partial, model)
        if read_config(partial) != model.config:   # a config field this writer does not know yet
            raise CheckpointError(f"{name_or_path}: the exported config.json reads back as {read_config(partial)}, "
                                  f"not {model.config}: export-hf needs updating for this model")
        _move_into_place(partial, out, force)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _source_gguf(name_or_path: str) -> Path:
    if name_or_path in PRESETS:
        raise CheckpointError(f"{name_or_path!r} is a preset (GPT-2 shape, random weights, byte tokenizer) that "
                              f"vLLM and transformers cannot use; {EXPORTABLE}")
    if name_or_path in NAMED_GGUF:
        return named_gguf_path(name_or_path)
    path = Path(name_or_path)
    if path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder: if it is a Hugging Face checkpoint, vLLM and transformers "
                              f"load it as it is; {EXPORTABLE}")
    raise CheckpointError(f"{name_or_path!r} is neither a named model nor a .gguf file; {EXPORTABLE}")


def _check_target(out: Path, force: bool) -> None:
    """An empty or missing folder is written; force replaces a model folder, never any other folder."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} is a file: give the path of a folder to write the model into")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not force:
        raise CheckpointError(f"{out} already exists and is not empty: choose another folder, or pass --force "
                              f"to replace it")
    if not (out / "config.json").is_file():
        raise CheckpointError(f"{out} is not empty and holds no config.json: --force only replaces a model "
                              f"folder; choose another folder")


def _move_into_place(partial: Path, out: Path, force: bool) -> None:
    if not (force and out.is_dir() and any(out.iterdir())):
        os.replace(partial, out)   # replaces a missing or empty folder; fails if out was filled meanwhile
        return
    old = partial.with_suffix(".old")
    os.replace(out, old)
    try:
        os.replace(partial, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_folder(folder: Path, model: GGUFModel) -> None:
    from safetensors.numpy import save_file

    c, tok, bos = model.config, model.tokenizer, model.bos_token_id
    eos = [c.eos_token_id, *c.extra_eos_token_ids]
    eos = eos if len(eos) > 1 else eos[0]
    _write_json(folder / "config.json", hf_config(c, bos, eos))
    # transformers refuses a safetensors file whose metadata does not name its format.
    save_file({name if name == "lm_head.weight" else PREFIX + name: np.ascontiguousarray(t, dtype=np.float32)
               for name, t in model.tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copymode(folder / "config.json", folder / "model.safetensors")   # safetensors writes it 0600
    tok.save(str(folder / "tokenizer.json"))
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.id_to_token(bos) if bos is not None else None,
        "eos_token": tok.id_to_token(c.eos_token_id),
        "add_bos_token": _adds_bos(tok, bos),
        "model_max_length": c.max_positions,
        # transformers would otherwise rewrite " ," to "," when decoding: not what the model said.
        "clean_up_tokenization_spaces": False,
        **({"chat_template": model.chat_template} if model.chat_template else {}),
    })
    _write_json(folder / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})


def hf_config(c: ModelConfig, bos_token_id: int | None, eos_token_id) -> dict:
    """config.json of a Llama-family ModelConfig: Qwen2 when q/k/v have biases, Mistral for a
    sliding window without them, Llama otherwise."""
    if c.arch != "llama":
        raise CheckpointError(f"a {c.describe()} model cannot be exported; {EXPORTABLE}")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.d_model,
              "intermediate_size": c.d_ff, "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
              "num_key_value_heads": c.n_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.norm_eps,
              "rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling, "max_position_embeddings": c.max_positions,
              "tie_word_embeddings": bool(c.tie_word_embeddings), "vocab_size": c.vocab_size,
              "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "hidden_act": c.activation,
              "torch_dtype": "float32"}
    if c.qkv_bias:
        config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                      use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                      max_window_layers=0 if c.sliding_window else c.n_layers)
    elif c.sliding_window:
        config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=c.sliding_window)
    return config


def _adds_bos(tok, bos_token_id: int | None) -> bool:
    """Whether the tokenizer puts BOS before a text: read_gguf built it as the GGUF's add_bos_token says."""
    if bos_token_id is None:
        return False
    ids, plain = tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids
    return len(ids) > len(plain) and ids[0] == bos_token_id


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
