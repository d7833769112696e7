"""GGUF files for tests, written with gguf.GGUFWriter as llama.cpp's converter writes them (Q/K rows
permuted, norms in F32), and the same weights as a Hugging Face folder (safetensors) to compare."""

from __future__ import annotations

import json

import gguf
import numpy as np
from safetensors.numpy import save_file

from worker.model.gguf_file import LAYER_NAMES, TOP_NAMES, permute_rows

T = gguf.GGMLQuantizationType
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(vocab_size=300):
    """A small byte-level BPE (GPT-2 style) with ChatML's special tokens at ids 0..2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "the hat of the cat", "What is the capital?"] * 50, trainer)
    return tok


def tokenizer_metadata(tok) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as 'a b', token types) as llama.cpp's converter stores them."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def hf_to_gguf_tensors(tensors: dict[str, np.ndarray], n_heads: int, n_kv_heads: int) -> dict[str, np.ndarray]:
    """HF (canonical) names and layout -> GGUF names, Q/K rows permuted as convert_hf_to_gguf does."""
    top = {c: g for g, c in TOP_NAMES.items()}
    layer = {c: g for g, c in LAYER_NAMES.items()}
    out = {}
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest == "self_attn.q_proj.weight":
            t = permute_rows(t, n_heads)
        elif rest == "self_attn.k_proj.weight":
            t = permute_rows(t, n_kv_heads)
        out[f"blk.{i}.{layer[rest]}"] = t
    return out


def write_gguf(path, config, tensors, qtype=T.F32, arch="llama", tok=None, chat_template=CHATML, raw=None,
               sliding_window=None, tokenizer_model="gpt2"):
    """A GGUF of a Llama config and HF-named float32 tensors; 2-D weights in `qtype` (norms F32).
    raw: {gguf name: (uint8 bytes array, type)} written as given instead. -> {gguf name: stored array}."""
    tok = tok or train_tokenizer(config.vocab_size)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.n_layers)
    w.add_context_length(config.max_positions)
    w.add_embedding_length(config.d_model)
    w.add_feed_forward_length(config.d_ff)
    w.add_head_count(config.n_heads)
    w.add_head_count_kv(config.n_kv_heads)
    w.add_layer_norm_rms_eps(config.norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_rope_dimension_count(config.head_dim)
    w.add_vocab_size(config.vocab_size)
    if sliding_window:
        w.add_sliding_window(sliding_window)
    tokens, merges, types = tokenizer_metadata(tok)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template:
        w.add_chat_template(chat_template)
    stored = {}
    raw = raw or {}
    for name, t in hf_to_gguf_tensors(tensors, config.n_heads, config.n_kv_heads).items():
        if name in raw:
            data, kind = raw[name]
        else:
            kind = qtype if t.ndim == 2 else T.F32
            data = gguf.quantize(t.astype(np.float32), kind)
        w.add_tensor(name, data, raw_dtype=kind)
        stored[name] = gguf.dequantize(data, kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def as_stored(tensors: dict[str, np.ndarray], qtype) -> dict[str, np.ndarray]:
    """The float32 weights a reader gets back from `qtype` (quantization acts row by row, so it
    commutes with the Q/K row permutation)."""
    return {n: gguf.dequantize(gguf.quantize(t, qtype if t.ndim == 2 else T.F32), qtype if t.ndim == 2 else T.F32)
            .reshape(t.shape).astype(np.float32) for n, t in tensors.items()}


def write_hf_folder(folder, config, tensors, tok=None, sliding_window=None):
    """The same weights as a Llama HF folder: config.json + model.safetensors (float32) + tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (tok or train_tokenizer(config.vocab_size)).save(str(folder / "tokenizer.json"))
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": config.n_layers,
           "hidden_size": config.d_model, "num_attention_heads": config.n_heads,
           "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.d_ff,
           "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
           "max_position_embeddings": config.max_positions, "tie_word_embeddings": bool(config.tie_word_embeddings),
           "hidden_act": "silu", "vocab_size": config.vocab_size, "eos_token_id": config.eos_token_id}
    if sliding_window:
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=sliding_window)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({("lm_head.weight" if n == "lm_head.weight" else "model." + n): np.ascontiguousarray(t)
               for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder
