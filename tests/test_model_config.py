"""config.json as different transformers releases write it: keys read where they are, nothing
assumed silently, unsupported variants refused by name."""

import json

import numpy as np
import pytest

from worker.model.config import PRESETS, CheckpointError, config_from_dict, read_config
from worker.model.llama import rope_inv_freq

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_positions": 128,
        "layer_norm_epsilon": 1e-5, "vocab_size": 257, "activation_function": "gelu_new", "eos_token_id": 256}
LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 160, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
         "tie_word_embeddings": False, "hidden_act": "silu", "vocab_size": 300, "eos_token_id": 2}


def test_gpt2_older_n_ctx_and_n_inner():
    c = config_from_dict({**{k: v for k, v in GPT2.items() if k != "n_positions"}, "n_ctx": 96, "n_inner": 100}, "x")
    assert (c.max_positions, c.d_ff, c.head_dim, c.n_kv_heads, c.tie_word_embeddings) == (96, 100, 16, 4, True)
    assert config_from_dict(GPT2, "x").d_ff == 256   # n_inner absent: 4 * n_embd, as GPT2Config documents


def test_llama_defaults_that_the_format_defines():
    c = config_from_dict(LLAMA, "x")
    assert (c.n_kv_heads, c.head_dim, c.norm_eps, c.rope_scaling) == (4, 16, 1e-6, None)
    c = config_from_dict({**LLAMA, "num_key_value_heads": 1, "head_dim": 32}, "x")
    assert (c.n_kv_heads, c.head_dim) == (1, 32)
    c = config_from_dict({**LLAMA, "eos_token_id": [2, 7, 9]}, "x")
    assert (c.eos_token_id, c.extra_eos_token_ids) == (2, (7, 9))


def test_eos_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "eos_token_id"}))
    with pytest.raises(CheckpointError, match="missing key 'eos_token_id'"):
        read_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert read_config(tmp_path).eos_token_id == 5


@pytest.mark.parametrize("drop", ["num_hidden_layers", "hidden_size", "intermediate_size", "rms_norm_eps",
                                  "max_position_embeddings", "vocab_size", "hidden_act", "model_type"])
def test_llama_missing_key_is_named(drop):
    with pytest.raises(CheckpointError, match=f"cfg.json: missing key '{drop}'"):
        config_from_dict({k: v for k, v in LLAMA.items() if k != drop}, "cfg.json")


def test_rope_theta_is_read_where_the_release_put_it():
    no_theta = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    with pytest.raises(CheckpointError, match="missing key 'rope_theta'"):
        config_from_dict(no_theta, "x")
    c = config_from_dict({**no_theta, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "x")
    assert (c.rope_theta, c.rope_scaling) == (5e5, None)
    with pytest.raises(CheckpointError, match="missing key 'rope_parameters.rope_theta'"):
        config_from_dict({**no_theta, "rope_parameters": {"rope_type": "default"}}, "x")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0},
    {"type": "dynamic", "factor": 2.0},
    {"rope_type": "longrope", "short_factor": [1.0]},
])
def test_unimplemented_rope_scaling_is_refused(scaling):
    with pytest.raises(CheckpointError, match="is not implemented"):
        config_from_dict({**LLAMA, "rope_scaling": scaling}, "x")
    params = {k: v for k, v in LLAMA.items() if k != "rope_theta"}
    with pytest.raises(CheckpointError, match="rope_parameters rope_type=.* is not implemented"):
        config_from_dict({**params, "rope_parameters": {**scaling, "rope_theta": 1e4}}, "x")


def test_linear_and_llama3_rope_scaling():
    base = rope_inv_freq(config_from_dict(LLAMA, "x"))
    linear = rope_inv_freq(config_from_dict({**LLAMA, "rope_scaling": {"type": "linear", "factor": 4.0}}, "x"))
    np.testing.assert_allclose(linear, base / 4.0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    c = config_from_dict({**LLAMA, "rope_scaling": scaling}, "x")
    got = rope_inv_freq(c)
    wavelen = 2 * np.pi / base
    high = wavelen < 64 / 4.0          # short wavelengths: unchanged
    low = wavelen > 64 / 1.0           # long wavelengths: divided by the factor
    assert high.any() and low.any() and (~high & ~low).any()
    np.testing.assert_allclose(got[high], base[high])
    np.testing.assert_allclose(got[low], base[low] / 8.0)
    mid = ~high & ~low                 # in between: between the two
    assert np.all(got[mid] <= base[mid]) and np.all(got[mid] >= base[mid] / 8.0)
    with pytest.raises(CheckpointError, match="rope_scaling.low_freq_factor"):
        config_from_dict({**LLAMA, "rope_scaling": {k: v for k, v in scaling.items() if k != "low_freq_factor"}}, "x")


@pytest.mark.parametrize("changes,message", [
    ({"attention_bias": True}, "attention_bias=True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ({"hidden_size": "64"}, "'hidden_size' should be a positive integer"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
])
def test_llama_variants_we_cannot_run_are_refused(changes, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict({**LLAMA, **changes}, "x")


def test_presets_have_the_documented_shapes():
    tiny, small = PRESETS["tiny"], PRESETS["gpt2-small-shape"]
    assert (tiny.n_layers, tiny.d_model, tiny.n_heads, tiny.head_dim, tiny.vocab_size) == (4, 256, 4, 64, 257)
    assert (small.n_layers, small.d_model, small.n_heads, small.head_dim, small.d_ff) == (12, 768, 12, 64, 3072)
    assert tiny.max_positions == small.max_positions == 1024
