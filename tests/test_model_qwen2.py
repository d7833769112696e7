"""Qwen2 (the Llama forward plus q/k/v biases): the same random weights as a Hugging Face folder and
as a GGUF written with llama.cpp's conventions for "qwen2" (Q/K rows as HF has them, biases in F32)
give the same logits; with zero biases they are exactly a Llama's (so the two GGUF rope conventions
agree); nonzero biases matter, and the paged forward and the engine equal a full recompute; what we
cannot run is refused by name."""

import dataclasses

import gguf
import numpy as np
import pytest

from gguf_helpers import T, as_stored, train_tokenizer, write_gguf, write_hf_folder
from worker.model import CheckpointError, ForwardBatch, load_model
from worker.model.config import config_from_dict
from worker.model.dense import reference_logits
from worker.model.testing import qwen2_config, random_tensors_for

IDS = [int(t) for t in np.random.default_rng(9).integers(3, 300, 29)]
BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(300)


def _config(**overrides):
    return qwen2_config(vocab_size=300, eos_token_id=2, **overrides)


def _without_biases(tensors):
    return {n: t for n, t in tensors.items() if not n.endswith(BIASES)}


@pytest.mark.parametrize("qtype,tied", [(T.F32, False), (T.F32, True), (T.Q8_0, True), (T.F16, False)])
def test_hf_folder_and_gguf_of_the_same_weights_give_the_same_logits(tmp_path, tok, qtype, tied):
    config = _config(tie_word_embeddings=tied)
    tensors = random_tensors_for(config, seed=31)
    write_gguf(tmp_path / "q.gguf", config, tensors, qtype, arch="qwen2", tok=tok, pre="qwen2")
    hf = load_model(str(write_hf_folder(tmp_path / "hf", config, as_stored(tensors, qtype), tok)))
    model = load_model(str(tmp_path / "q.gguf"))
    for loaded in (hf, model):
        c = loaded.config
        assert (c.arch, c.qkv_bias, c.tie_word_embeddings, c.rope_theta, c.n_kv_heads) == ("llama", True, tied, 1e6, 2)
    assert dataclasses.replace(model.config, norm_eps=hf.config.norm_eps) == hf.config   # GGUF: a float32 eps
    assert model.weights_digest == hf.weights_digest     # the same float32 weights, biases included
    want = reference_logits(hf, IDS)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-5, rtol=0)
    assert model.tokenizer.encode("the cat sat on the mat") == tok.encode("the cat sat on the mat").ids


def test_zero_biases_give_exactly_the_llama_logits(tmp_path, tok):
    """A "qwen2" GGUF (rows as HF has them) and a "llama" GGUF (rows permuted by the converter, undone
    at load) of the same weights, and the two HF folders: with zero biases, bit-identical logits."""
    config = _config()
    tensors = random_tensors_for(config, seed=32)
    for name in tensors:
        if name.endswith(BIASES):
            tensors[name] = np.zeros_like(tensors[name])
    llama_config = _config(qkv_bias=False)
    llama_tensors = _without_biases(tensors)
    write_gguf(tmp_path / "q.gguf", config, tensors, arch="qwen2", tok=tok)
    write_gguf(tmp_path / "l.gguf", llama_config, llama_tensors, arch="llama", tok=tok)
    stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    for gguf_name, name in [("attn_q.weight", "q_proj.weight"), ("attn_k.weight", "k_proj.weight")]:   # not permuted
        np.testing.assert_array_equal(stored["blk.0." + gguf_name], tensors["layers.0.self_attn." + name])
    want = reference_logits(load_model(str(tmp_path / "l.gguf")), IDS)
    np.testing.assert_array_equal(reference_logits(load_model(str(tmp_path / "q.gguf")), IDS), want)
    hf_qwen2 = load_model(str(write_hf_folder(tmp_path / "hf-qwen2", config, tensors, tok)))
    hf_llama = load_model(str(write_hf_folder(tmp_path / "hf-llama", llama_config, llama_tensors, tok)))
    np.testing.assert_array_equal(reference_logits(hf_qwen2, IDS), want)
    np.testing.assert_array_equal(reference_logits(hf_llama, IDS), want)


def _paged_generate(model, prompt, steps, page_tokens=4):
    """Prefill the prompt over a paged pool (blocks in shuffled order), then greedy decode steps
    one token at a time -> (tokens, logits of each step [steps, vocab])."""
    c = model.config
    blocks = -(-(len(prompt) + steps) // page_tokens)
    pool = np.zeros((blocks + 3, c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim), np.float32)
    table = np.random.default_rng(5).permutation(blocks + 3)[:blocks].astype(np.int32)
    n = len(prompt)
    logits = [model.forward(ForwardBatch(np.array(prompt), np.arange(n), np.array([0, n]), np.array([n]),
                                         [table]), pool)[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(model.forward(ForwardBatch(np.array(tokens[-1:]), np.array([n]), np.array([0, 1]),
                                                 np.array([n + 1]), [table]), pool)[0])
        tokens.append(int(logits[-1].argmax()))
        n += 1
    return tokens, np.array(logits)


def test_biases_change_the_logits_and_the_paged_forward_equals_a_full_recompute(tmp_path, tok):
    config = _config()
    tensors = random_tensors_for(config, seed=33)
    write_gguf(tmp_path / "q.gguf", config, tensors, T.Q8_0, arch="qwen2", tok=tok)
    model = load_model(str(tmp_path / "q.gguf"))
    zeroed = load_model(str(write_hf_folder(
        tmp_path / "zero", config, {n: np.zeros_like(t) if n.endswith(BIASES) else t
                                    for n, t in as_stored(tensors, T.Q8_0).items()}, tok)))
    assert np.abs(reference_logits(model, IDS) - reference_logits(zeroed, IDS)).max() > 0.05
    prompt = IDS[:11]
    tokens, logits = _paged_generate(model, prompt, 8)
    for step in range(8):
        want = reference_logits(model, prompt + tokens[:step])[-1]
        np.testing.assert_allclose(logits[step], want, atol=1e-4, rtol=0)
        assert tokens[step] == int(want.argmax())


def test_the_engine_generates_what_a_full_recompute_does(tmp_path, tok):
    """The engine on a Qwen2 GGUF with its ChatML template: a chat prefilled in chunks over 4-token
    pages, then greedy tokens; the same again from the prefix cache."""
    from worker.engine.engine import Engine

    config = _config(tie_word_embeddings=True)
    write_gguf(tmp_path / "q.gguf", config, random_tensors_for(config, seed=37), T.Q8_0, arch="qwen2", tok=tok,
               pre="qwen2")
    model = load_model(str(tmp_path / "q.gguf"))
    prompt = model.chat_token_ids([{"role": "user", "content": "What is the capital of the cat?"}])
    engine = Engine(model, num_blocks=32, page_tokens=4, max_num_batched_tokens=8, max_num_seqs=2, seed=0)
    cold = engine.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    ids = list(prompt)
    for _ in range(6):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    assert cold.token_ids == ids[len(prompt):]
    warm = engine.generate([prompt], max_new_tokens=6, ignore_eos=True)[0]
    assert warm.usage.cached_tokens_local > 0 and warm.token_ids == cold.token_ids


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("dropped,name", [("blk.1.attn_k.bias", "layers.1.self_attn.k_proj.bias"),
                                          ("blk.0.attn_q.bias", "layers.0.self_attn.q_proj.bias")])
def test_a_gguf_missing_a_bias_is_refused_by_name(tmp_path, tok, dropped, name):
    config = _config()
    tensors = random_tensors_for(config, seed=34)
    del tensors[name]
    write_gguf(tmp_path / "q.gguf", config, tensors, arch="qwen2", tok=tok)
    with pytest.raises(CheckpointError, match=rf"q.gguf: missing tensor '{dropped}' of a 2-layer llama with q/k/v "
                                              r"biases \(Qwen2\) model"):
        load_model(str(tmp_path / "q.gguf"))


def test_a_hf_folder_missing_a_bias_is_refused_by_name(tmp_path, tok):
    config = _config()
    tensors = random_tensors_for(config, seed=35)
    del tensors["layers.1.self_attn.v_proj.bias"]
    folder = write_hf_folder(tmp_path / "hf", config, tensors, tok)
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers.1.self_attn.v_proj.bias' for llama with "
                                              r"q/k/v biases \(Qwen2\)"):
        load_model(str(folder))


def test_biases_where_the_architecture_has_none_are_refused(tmp_path, tok):
    config = _config()
    tensors = random_tensors_for(config, seed=36)
    write_gguf(tmp_path / "l.gguf", _config(qkv_bias=False), tensors, arch="llama", tok=tok)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'blk.0.attn_k.bias' for a 2-layer llama model"):
        load_model(str(tmp_path / "l.gguf"))
    tensors["layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)   # Qwen2 has no o_proj bias
    folder = write_hf_folder(tmp_path / "hf", config, tensors, tok)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers.0.self_attn.o_proj.bias' \(not part of "
                                              r"a llama with q/k/v biases \(Qwen2\) model"):
        load_model(str(folder))


QWEN2_JSON = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 4,
              "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 160,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
              "tie_word_embeddings": True, "hidden_act": "silu", "vocab_size": 300, "eos_token_id": 2,
              "use_sliding_window": False, "sliding_window": 64, "max_window_layers": 2}


@pytest.mark.parametrize("changes,window", [
    ({}, None),                                                              # Qwen2.5's configs
    ({"use_sliding_window": True, "max_window_layers": 0}, 64),              # every layer windowed
    ({"use_sliding_window": True, "max_window_layers": 4}, None),            # no layer windowed
    ({"use_sliding_window": True, "layer_types": ["sliding_attention"] * 4}, 64),
    ({"use_sliding_window": False, "max_window_layers": 0}, None),           # the window is off
])
def test_a_sliding_window_on_every_layer_or_none_is_read(changes, window):
    c = config_from_dict({**QWEN2_JSON, **changes}, "config.json")
    assert (c.qkv_bias, c.sliding_window, c.layer_windows()) == (True, window, [window] * 4)


@pytest.mark.parametrize("changes,message", [
    ({"use_sliding_window": True}, r"use_sliding_window=true with max_window_layers=2 puts a sliding window on 2 "
                                   r"of the 4 layers only; a window on some layers and not others is not supported"),
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 3 + ["sliding_attention"]},
     r"use_sliding_window=true with layer_types puts a sliding window on 1 of the 4 layers only"),
    ({"use_sliding_window": True, "layer_types": ["full_attention"] * 3}, r"key 'layer_types' should list"),
    ({"use_sliding_window": True, "max_window_layers": None}, r"needs key 'max_window_layers'"),
    ({"use_sliding_window": "yes"}, r"key 'use_sliding_window' should be true/false"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     r"rope_scaling rope_type='yarn' is not implemented"),
    ({"architectures": ["Qwen2ForSequenceClassification"]}, r"unsupported architectures"),
])
def test_what_qwen2_cannot_run_is_refused_by_name(changes, message):
    with pytest.raises(CheckpointError, match=r"config.json: .*" + message):
        config_from_dict({**QWEN2_JSON, **changes}, "config.json")


def test_the_bias_flag_leaves_earlier_models_fingerprints_as_they_were():
    # A model without biases is described as before the flag existed, so the pages kvnodes hold
    # for it (keyed by the fingerprint) stay valid across an upgrade; a model with them differs.
    plain = qwen2_config(qkv_bias=False)
    assert "qkv_bias" not in plain.to_json()
    assert '"qkv_bias":true' in qwen2_config().to_json()
    assert dataclasses.replace(plain, qkv_bias=True).to_json() != plain.to_json()
