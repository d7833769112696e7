"""Fixed-seed weights for the presets: the same numbers on every machine (PCG64 stream, float32).

GPT-2's own init (std 0.02 everywhere) gives a model whose greedy output repeats one token.
Measured (greedy tokens from a few prompts): linear maps at unit gain (std 1/sqrt(fan_in)),
the projections back into the residual stream scaled by 1/sqrt(2 n_layers) as GPT-2 does,
token embeddings at std 0.1 (logits of a few units, so greedy choices are not near-ties) and
position embeddings at std 1.0 give many distinct tokens per generation and continuations
that differ between prompts, for both presets.
"""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


# Linear maps whose output is added to the residual stream.
RESIDUAL_PROJECTIONS = ("c_proj.weight", "o_proj.weight", "down_proj.weight")
# Qwen2's q/k/v biases: std 0.5, so that a test model's logits move visibly with them (trained
# Qwen2 checkpoints carry large biases too); GPT-2's biases keep std 0.02 (the presets' weights).
QKV_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


def random_tensors(shapes: dict[str, tuple[int, ...]], c: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():          # insertion order is part of the stream: keep it fixed
        if len(shape) == 1:
            if name.endswith(QKV_BIASES):
                t = 0.5 * rng.standard_normal(shape, dtype=np.float32)
            elif name.endswith(".bias"):
                t = 0.02 * rng.standard_normal(shape, dtype=np.float32)
            else:                               # norm gains around 1
                t = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        elif name in ("wte.weight", "embed_tokens.weight", "lm_head.weight", "wpe.weight"):
            t = rng.standard_normal(shape, dtype=np.float32)
            t *= 1.0 if name == "wpe.weight" else 0.1
        else:                                   # linear maps: unit gain on the input width
            fan_in = shape[0] if c.arch == "gpt2" else shape[1]
            t = rng.standard_normal(shape, dtype=np.float32)
            t *= 1.0 / math.sqrt(fan_in)
            if name.endswith(RESIDUAL_PROJECTIONS):
                t *= 1.0 / math.sqrt(2 * c.n_layers)
        tensors[name] = t.astype(np.float32, copy=False)
    return tensors
