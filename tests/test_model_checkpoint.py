"""Hugging Face checkpoint folders written here with safetensors load, run the same math as an
independent textbook forward over the same arrays, and broken folders are refused by name."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from worker.model import CheckpointError, ForwardBatch, load_model
from worker.model.dense import reference_logits
from worker.model.testing import gpt2_config, llama_config, qwen2_config, random_tensors_for

GPT2_JSON = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
             "n_positions": 128, "n_ctx": 128, "layer_norm_epsilon": 1e-5, "vocab_size": 257,
             "activation_function": "gelu_new", "bos_token_id": 256, "eos_token_id": 256}
LLAMA_JSON = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
              "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
              "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 257, "eos_token_id": 256}
IDS = [int(t) for t in np.random.default_rng(7).integers(0, 256, 21)]


def write_folder(folder, config_json, tensors, prefix="", dtype=np.float32, shards=1, extra=None):
    """An HF-style folder: config.json plus one safetensors file or `shards` files and an index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json))
    named = {(name if name == "lm_head.weight" else prefix + name): t.astype(dtype) for name, t in tensors.items()}
    named.update(extra or {})
    if shards == 1:
        save_file(named, str(folder / "model.safetensors"))
        return folder
    names = list(named)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: named[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ------------------------------------------------------------------ independent textbook forwards (float64)

def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _causal_attention(q, k, v):
    # q, k, v [heads, T, hd]
    T = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1]) + np.triu(np.full((T, T), -np.inf), 1)
    return _softmax(scores) @ v


def textbook_gpt2(t, n_head, ids, eps=1e-5):
    t = {k: v.astype(np.float64) for k, v in t.items()}

    def ln(x, p):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[p + ".weight"] + t[p + ".bias"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    x = t["wte.weight"][ids] + t["wpe.weight"][np.arange(len(ids))]
    n_layer = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("h."))
    for i in range(n_layer):
        h = f"h.{i}."
        qkv = ln(x, h + "ln_1") @ t[h + "attn.c_attn.weight"] + t[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(len(ids), n_head, -1).transpose(1, 0, 2) for a in np.split(qkv, 3, axis=-1))
        a = _causal_attention(q, k, v).transpose(1, 0, 2).reshape(len(ids), -1)
        x = x + a @ t[h + "attn.c_proj.weight"] + t[h + "attn.c_proj.bias"]
        m = gelu(ln(x, h + "ln_2") @ t[h + "mlp.c_fc.weight"] + t[h + "mlp.c_fc.bias"])
        x = x + m @ t[h + "mlp.c_proj.weight"] + t[h + "mlp.c_proj.bias"]
    return ln(x, "ln_f") @ t["wte.weight"].T


def textbook_llama(t, n_head, n_kv, theta, ids, eps=1e-5):
    t = {k: v.astype(np.float64) for k, v in t.items()}
    T = len(ids)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rotate_half(x):
        half = x.shape[-1] // 2
        return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    x = t["embed_tokens.weight"][ids]
    hd = t["layers.0.self_attn.q_proj.weight"].shape[0] // n_head
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(T), inv_freq)] * 2, axis=-1)      # [T, hd]
    cos, sin = np.cos(emb), np.sin(emb)
    n_layer = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    for i in range(n_layer):
        p = f"layers.{i}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q, k, v = (h @ t[p + f"self_attn.{n}_proj.weight"].T + t.get(p + f"self_attn.{n}_proj.bias", 0.0)
                   for n in "qkv")                                              # biases: Qwen2
        q = q.reshape(T, n_head, hd).transpose(1, 0, 2)
        k = k.reshape(T, n_kv, hd).transpose(1, 0, 2)
        v = v.reshape(T, n_kv, hd).transpose(1, 0, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, n_head // n_kv, axis=0), np.repeat(v, n_head // n_kv, axis=0)   # HF repeat_kv
        a = _causal_attention(q, k, v).transpose(1, 0, 2).reshape(T, -1)
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["embed_tokens.weight"])
    return rms(x, t["norm.weight"]) @ head.T


def _paged_logits(model, ids, page_tokens=8):
    c = model.config
    blocks = -(-len(ids) // page_tokens)
    pool = np.zeros((blocks + 2, c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim), np.float32)
    batch = ForwardBatch(np.array(ids), np.arange(len(ids)), np.array([0, len(ids)]), np.array([len(ids)]),
                         [np.arange(blocks, dtype=np.int32)[::-1].copy()], all_logits=True)
    return model.forward(batch, pool)


def _as_loaded(tensors, dtype):
    return {k: v.astype(dtype).astype(np.float32) for k, v in tensors.items()}


# ------------------------------------------------------------------ loading

@pytest.mark.parametrize("prefix,dtype", [("transformer.", np.float32), ("", np.float16)])
def test_gpt2_folder_loads_and_matches_textbook_forward(tmp_path, prefix, dtype):
    tensors = random_tensors_for(gpt2_config(), seed=11)
    # What GPT2LMHeadModel checkpoints also carry: causal-mask buffers and (sometimes) the tied head.
    extra = {prefix + "h.0.attn.bias": np.tril(np.ones((1, 1, 128, 128), np.float32)),
             "lm_head.weight": tensors["wte.weight"].astype(dtype)}
    folder = write_folder(tmp_path / "gpt2", GPT2_JSON, tensors, prefix=prefix, dtype=dtype, extra=extra)
    model = load_model(str(folder))
    assert (model.config.arch, model.config.n_layers, model.config.max_positions) == ("gpt2", 2, 128)
    want = textbook_gpt2(_as_loaded(tensors, dtype), 4, IDS)
    np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_paged_logits(model, IDS), want, atol=1e-4, rtol=0)


def test_llama_gqa_untied_sharded_loads_and_matches_textbook_forward(tmp_path):
    tensors = random_tensors_for(llama_config(), seed=12)
    folder = write_folder(tmp_path / "llama", LLAMA_JSON, tensors, prefix="model.", shards=2)
    model = load_model(str(folder))
    c = model.config
    assert (c.arch, c.n_heads, c.n_kv_heads, c.tie_word_embeddings) == ("llama", 4, 2, False)
    want = textbook_llama(tensors, 4, 2, 10000.0, IDS)
    np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_paged_logits(model, IDS), want, atol=1e-4, rtol=0)


def test_qwen2_folder_with_qkv_biases_matches_textbook_forward(tmp_path):
    """Qwen2.5's config.json (no attention_bias key: Qwen2 always has q/k/v biases, never o_proj's)."""
    tensors = random_tensors_for(qwen2_config(tie_word_embeddings=True), seed=18)
    cfg = {**LLAMA_JSON, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rope_theta": 1000000.0,
           "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768,
           "max_window_layers": 21, "attention_dropout": 0.0, "rope_scaling": None}
    model = load_model(str(write_folder(tmp_path / "qwen2", cfg, tensors, prefix="model.")))
    c = model.config
    assert (c.qkv_bias, c.tie_word_embeddings, c.rope_theta, c.sliding_window) == (True, True, 1e6, None)
    want = textbook_llama(tensors, 4, 2, 1e6, IDS)
    np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(_paged_logits(model, IDS), want, atol=1e-4, rtol=0)
    no_bias = {n: t for n, t in tensors.items() if not n.endswith(".bias")}
    assert np.abs(textbook_llama(no_bias, 4, 2, 1e6, IDS) - want).max() > 0.05   # the biases matter


def test_llama_tied_bf16_newer_config_layout(tmp_path):
    tensors = random_tensors_for(llama_config(tie_word_embeddings=True, rope_theta=500000.0), seed=13)
    cfg = {k: v for k, v in LLAMA_JSON.items() if k != "rope_theta"}
    # transformers 5 writes rope_parameters instead of rope_theta / rope_scaling.
    cfg.update(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    bf16_bits = {}
    for name, t in tensors.items():   # NumPy has no bfloat16: store the top 16 bits by hand
        bits = (t.view(np.uint32) >> 16).astype(np.uint16)
        bf16_bits[name] = (bits.astype(np.uint32) << 16).view(np.float32)
    folder = tmp_path / "llama-bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    _save_bf16({"model." + n: t for n, t in tensors.items()}, folder / "model.safetensors")
    model = load_model(str(folder))
    assert model.config.tie_word_embeddings and model.config.rope_theta == 500000.0
    want = textbook_llama(bf16_bits, 4, 2, 500000.0, IDS)
    np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-4, rtol=0)


def _save_bf16(tensors, path):
    """safetensors file with BF16 tensors, laid out by the format's spec (header length, JSON, data)."""
    header, chunks, offset = {}, [], 0
    for name, t in tensors.items():
        raw = (np.ascontiguousarray(t).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


# ------------------------------------------------------------------ refusals

def _gpt2_folder(tmp_path, config_changes=None, drop=(), reshape=None, **kw):
    cfg = {**GPT2_JSON, **(config_changes or {})}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    tensors = random_tensors_for(gpt2_config(), seed=14)
    for name in drop:
        del tensors[name]
    if reshape:
        tensors[reshape[0]] = np.zeros(reshape[1], np.float32)
    return write_folder(tmp_path / "broken", cfg, tensors, prefix="transformer.", **kw)


@pytest.mark.parametrize("changes,message", [
    ({"n_head": None}, "missing key 'n_head'"),
    ({"n_positions": None, "n_ctx": None}, "missing key 'n_positions' or 'n_ctx'"),
    ({"layer_norm_epsilon": None}, "missing key 'layer_norm_epsilon'"),
    ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]}, "unsupported architecture model_type='falcon'"),
    ({"architectures": ["GPT2ForSequenceClassification"]}, "GPT2ForSequenceClassification"),
    ({"activation_function": "relu"}, "activation_function='relu' is not supported"),
    ({"eos_token_id": None}, "missing key 'eos_token_id'"),
])
def test_bad_config_is_refused_naming_key_and_file(tmp_path, changes, message):
    folder = _gpt2_folder(tmp_path, changes)
    with pytest.raises(CheckpointError) as e:
        load_model(str(folder))
    assert message in str(e.value)
    assert "config.json" in str(e.value)


def test_missing_tensor_is_named(tmp_path):
    folder = _gpt2_folder(tmp_path, drop=["h.1.mlp.c_fc.bias"])
    message = r"missing tensor 'h\.1\.mlp\.c_fc\.bias' for gpt2 \(looked for it with and without the 'transformer\.'"
    with pytest.raises(CheckpointError, match=message):
        load_model(str(folder))


def test_wrong_shape_names_tensor_expected_and_got(tmp_path):
    folder = _gpt2_folder(tmp_path, reshape=("h.0.attn.c_attn.weight", (64, 190)))
    with pytest.raises(CheckpointError) as e:
        load_model(str(folder))
    msg = str(e.value)
    assert "'h.0.attn.c_attn.weight'" in msg and "[64, 190]" in msg and "expected [64, 192]" in msg


def test_unexpected_tensor_is_refused(tmp_path):
    folder = _gpt2_folder(tmp_path, extra={"transformer.h.0.attn.q_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensor 'h.0.attn.q_norm.weight'"):
        load_model(str(folder))


def test_missing_shard_and_missing_weights_are_named(tmp_path):
    folder = _gpt2_folder(tmp_path, shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard file 'model-00002-of-00002.safetensors' is missing"):
        load_model(str(folder))
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        load_model(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(folder))
    with pytest.raises(CheckpointError, match="neither a preset"):
        load_model(str(tmp_path / "nowhere"))


def test_corrupt_safetensors_file_is_refused(tmp_path):
    folder = _gpt2_folder(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_model(str(folder))


def test_untied_llama_without_lm_head_is_refused(tmp_path):
    tensors = random_tensors_for(llama_config(), seed=15)
    del tensors["lm_head.weight"]
    folder = write_folder(tmp_path / "llama", LLAMA_JSON, tensors, prefix="model.")
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight' for llama$"):
        load_model(str(folder))


# ------------------------------------------------------------------ tokenizer.json

def _train_byte_bpe(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "the hat of the cat"] * 50, trainer)
    tok.save(str(path))
    return tok


def test_folder_with_tokenizer_json_uses_it(tmp_path):
    tensors = random_tensors_for(gpt2_config(vocab_size=300, eos_token_id=0), seed=16)
    folder = write_folder(tmp_path / "bpe", {**GPT2_JSON, "vocab_size": 300, "eos_token_id": 0}, tensors)
    trained = _train_byte_bpe(folder / "tokenizer.json")
    model = load_model(str(folder))
    text = "the cat sat on the mat"
    ids = model.tokenizer.encode(text)
    assert ids == trained.encode(text).ids
    assert len(ids) < len(text.encode())           # merges were used: not the byte tokenizer
    assert model.tokenizer.decode(ids) == text
    assert model.tokenizer.eos_token_id == 0
    e_acute = model.tokenizer.encode("é")           # two byte-level tokens, never merged
    assert len(e_acute) == 2
    assert model.tokenizer.decode(e_acute[:1]) == "\ufffd"    # half a character: replaced, no exception
    assert model.tokenizer.decode(e_acute) == "é"


def test_byte_tokenizer_for_folders_without_tokenizer_json(tmp_path):
    model = load_model(str(_gpt2_folder(tmp_path)))
    ids = model.tokenizer.encode("hé!")
    assert ids == [104, 195, 169, 33]
    assert model.tokenizer.decode(ids + [256]) == "hé!"        # end-of-text decodes to nothing
    assert model.tokenizer.decode(ids[:2]) == "h\ufffd"        # a cut inside a character
    assert model.tokenizer.eos_token_id == 256


# ------------------------------------------------------------------ fingerprint

def test_fingerprint_covers_kv_dtype_page_size_and_weights(tmp_path):
    folder = _gpt2_folder(tmp_path)
    a, b = load_model(str(folder)), load_model(str(folder))
    fp = a.fingerprint("float32", 16)
    assert len(fp) == 16 and fp == b.fingerprint("float32", 16)
    assert a.weights_digest == b.weights_digest
    assert fp != a.fingerprint("float16", 16)
    assert fp != a.fingerprint("float32", 32)
    tensors = random_tensors_for(gpt2_config(), seed=14)
    tensors["h.1.mlp.c_fc.bias"][3] += 1e-3          # one weight differs
    other = load_model(str(write_folder(tmp_path / "other", GPT2_JSON, tensors, prefix="transformer.")))
    assert other.weights_digest != a.weights_digest
    assert other.fingerprint("float32", 16) != fp
    assert load_model("tiny").fingerprint("float32", 16) == load_model("tiny").fingerprint("float32", 16)
    assert load_model("tiny").fingerprint("float32", 16) != fp
    assert a.page_bytes("float32", 16) == 2 * 2 * 4 * 16 * 16 * 4
    assert a.page_bytes("float16", 16) == a.page_bytes("float32", 16) // 2
    assert len({fp, a.fingerprint("int8", 16), a.fingerprint("int4", 16)}) == 3   # quantized pages apart too
    with pytest.raises(ValueError, match="kv_dtype"):
        a.fingerprint("bfloat16", 16)


def test_prefix_and_dtype_of_the_files_do_not_change_the_digest(tmp_path):
    tensors = random_tensors_for(gpt2_config(), seed=17)
    half = _as_loaded(tensors, np.float16)
    a = load_model(str(write_folder(tmp_path / "a", GPT2_JSON, tensors, prefix="transformer.", dtype=np.float16)))
    b = load_model(str(write_folder(tmp_path / "b", GPT2_JSON, half, prefix="")))
    assert a.weights_digest == b.weights_digest       # same float32 weights, same model
