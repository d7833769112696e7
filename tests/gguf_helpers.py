"""GGUF files for tests, written with gguf.GGUFWriter as llama.cpp's converter writes them (Q/K rows
of "llama" permuted, "qwen2" as HF has them, norms and biases in F32), and the same weights as a
Hugging Face folder (safetensors) to compare;
SentencePiece vocabularies trained in-process, the ground truth of a "llama" tokenizer."""

from __future__ import annotations

import json

import gguf
import numpy as np
from safetensors.numpy import save_file

from worker.model.gguf_file import LAYER_NAMES, PERMUTED_QK_ARCHS, TOP_NAMES, permute_rows

T = gguf.GGMLQuantizationType
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 2's chat template (bos_token and [INST] markers), shortened to what the tests send.
LLAMA2_CHAT = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
               "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + "
               "eos_token }}{% endif %}{% endfor %}")
SPM_TEXT = ["The quick brown fox jumps over the lazy dog.", "Hello, world! How are you today?",
            "In 1984, 42 people paid $3.50 each.", "the cat sat on the mat; the hat of the cat",
            "What is the capital of France? Paris is the capital.", "  indented   with    spaces  ",
            "naïve café déjà vu", "def main():    return x + y * 2", "tokenizers split pieces into merges"]


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


def train_sentencepiece(vocab_size=400, user_defined=(), **options):
    """A small SentencePiece BPE with byte fallback, trained as Llama's tokenizer.model was (no
    normalization, spaces kept as they are, digits split, pieces of spaces only): <unk>, <s>, </s>
    at ids 0..2, then the 256 byte pieces. -> sentencepiece.SentencePieceProcessor"""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_TEXT * 20), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, hard_vocab_limit=False,
        user_defined_symbols=list(user_defined), minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def sentencepiece_metadata(sp, user_defined=()) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, GGUF token types) as llama.cpp's converter stores a tokenizer.model."""
    def kind(i):
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_unused(i):
            return 5
        if sp.is_byte(i):
            return 6
        return 4 if sp.id_to_piece(i) in user_defined else 1

    n = sp.get_piece_size()
    return [sp.id_to_piece(i) for i in range(n)], [sp.get_score(i) for i in range(n)], [kind(i) for i in range(n)]


def tokenizer_metadata(tok) -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges as 'a b', token types) as llama.cpp's converter stores them."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, merges, types


def hf_to_gguf_tensors(tensors: dict[str, np.ndarray], n_heads: int, n_kv_heads: int,
                       permute: bool = True) -> dict[str, np.ndarray]:
    """HF (canonical) names and layout -> GGUF names; with `permute`, Q/K rows (weights and biases)
    permuted as convert_hf_to_gguf does for "llama"."""
    top = {c: g for g, c in TOP_NAMES.items()}
    layer = {c: g for g, c in LAYER_NAMES.items()}
    out = {}
    for name, t in tensors.items():
        if name in top:
            out[top[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if permute and rest.startswith("self_attn.q_proj."):
            t = permute_rows(t, n_heads)
        elif permute and rest.startswith("self_attn.k_proj."):
            t = permute_rows(t, n_kv_heads)
        out[f"blk.{i}.{layer[rest]}"] = t
    return out


def write_gguf(path, config, tensors, qtype=T.F32, arch="llama", tok=None, chat_template=CHATML, raw=None,
               sliding_window=None, tokenizer_model="gpt2", spm=None, spm_keys=None, pre="default"):
    """A GGUF of a Llama config and HF-named float32 tensors; 2-D weights in `qtype` (norms F32).
    arch "qwen2": the Q/K rows as they are, q/k/v biases among the tensors (if the config has them).
    raw: {gguf name: (uint8 bytes array, type)} written as given instead. spm: a SentencePiece
    vocabulary (pieces, scores, types) written instead of `tok`'s, with BOS added unless spm_keys
    ({key: bool} of tokenizer.ggml.add_bos_token, ...) says otherwise. -> {gguf name: stored array}."""
    tok = None if spm else tok or train_tokenizer(config.vocab_size)
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
    if spm:
        tokens, scores, types = spm
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        if scores is not None:
            w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        for key, value in {"tokenizer.ggml.add_bos_token": True, **(spm_keys or {})}.items():
            w.add_bool(key, value)
    else:
        tokens, merges, types = tokenizer_metadata(tok)
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template:
        w.add_chat_template(chat_template)
    stored = {}
    raw = raw or {}
    for name, t in hf_to_gguf_tensors(tensors, config.n_heads, config.n_kv_heads, arch in PERMUTED_QK_ARCHS).items():
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
    """The same weights as a Llama HF folder: config.json + model.safetensors (float32) + tokenizer.json;
    a Qwen2 one (as Qwen2.5 writes its config) when the config has q/k/v biases."""
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
    if config.qkv_bias:
        cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False,
                   sliding_window=4096, max_window_layers=config.n_layers, attention_dropout=0.0)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({("lm_head.weight" if n == "lm_head.weight" else "model." + n): np.ascontiguousarray(t)
               for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder
