"""Small random models for tests (ours and the engine's): any shape, no files."""

from __future__ import annotations

from . import Model
from .checkpoint import ARCH_MODULES
from .config import ModelConfig
from .init import random_tensors
from .tokenizer import ByteTokenizer


def gpt2_config(**overrides) -> ModelConfig:
    fields = dict(arch="gpt2", vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=16,
                  d_ff=256, max_positions=128, norm_eps=1e-5, eos_token_id=256, tie_word_embeddings=True,
                  activation="gelu_tanh")
    fields.update(overrides)
    return ModelConfig(**fields)


def llama_config(**overrides) -> ModelConfig:
    """GQA (4 query heads over 2 KV heads) and an untied head unless overridden."""
    fields = dict(arch="llama", vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  d_ff=160, max_positions=128, norm_eps=1e-5, eos_token_id=256, tie_word_embeddings=False,
                  activation="silu", rope_theta=10000.0)
    fields.update(overrides)
    return ModelConfig(**fields)


def qwen2_config(**overrides) -> ModelConfig:
    """A Llama config with q/k/v biases and Qwen2's RoPE base; GQA and untied unless overridden."""
    return llama_config(**{"qkv_bias": True, "rope_theta": 1000000.0, **overrides})


def random_tensors_for(config: ModelConfig, seed: int = 0):
    """Checkpoint-named float32 weights for a config (the presets' init)."""
    return random_tensors(ARCH_MODULES[config.arch].tensor_shapes(config), config, seed)


def random_model(config: ModelConfig, seed: int = 0, name: str = "random", invariant: bool | None = None) -> Model:
    return Model(name, config, random_tensors_for(config, seed), ByteTokenizer(config.eos_token_id),
                 invariant=invariant)
