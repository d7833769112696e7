"""GPT-2 forward in NumPy (picoGPT's shape, with the KV cache passed in through `attend`).

Learned positions, pre-LayerNorm blocks, tanh GELU, fused c_attn Conv1D weights stored [in, out],
LM head tied to the token embedding (or lm_head.weight when a config unties it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .invariant import Linear, TiedEmbedding
from .layers import Attend, BetweenLayers, gelu_tanh_, layer_norm

# Buffers some GPT-2 checkpoints carry that are not weights (the causal mask).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
PREFIX = "transformer."


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a GPT-2 checkpoint must hold (names without the `transformer.` prefix)."""
    d, ff = c.d_model, c.d_ff
    shapes = {"wte.weight": (c.vocab_size, d), "wpe.weight": (c.max_positions, d)}
    for i in range(c.n_layers):
        h = f"h.{i}."
        shapes.update({
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "mlp.c_fc.weight": (d, ff), h + "mlp.c_fc.bias": (ff,),
            h + "mlp.c_proj.weight": (ff, d), h + "mlp.c_proj.bias": (d,),
        })
    shapes.update({"ln_f.weight": (d,), "ln_f.bias": (d,)})
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


# Weight matrices are arrays [in, out], or Linear (the same, with batch-invariant rows) when invariant.
@dataclass
class Block:
    ln_1_g: np.ndarray       # [d]
    ln_1_b: np.ndarray       # [d]
    c_attn_w: np.ndarray     # [d, 3d]  (q | k | v)
    c_attn_b: np.ndarray     # [3d]
    attn_proj_w: np.ndarray  # [d, d]
    attn_proj_b: np.ndarray  # [d]
    ln_2_g: np.ndarray
    ln_2_b: np.ndarray
    c_fc_w: np.ndarray       # [d, ff]
    c_fc_b: np.ndarray       # [ff]
    mlp_proj_w: np.ndarray   # [ff, d]
    mlp_proj_b: np.ndarray   # [d]


@dataclass
class Params:
    wte: np.ndarray          # [vocab, d] (rows read from lm_head when tied and invariant)
    wpe: np.ndarray          # [max_positions, d]
    blocks: list[Block]
    ln_f_g: np.ndarray
    ln_f_b: np.ndarray
    lm_head: np.ndarray      # [d, vocab]: wte.T when tied


def build_params(t: dict[str, np.ndarray], c: ModelConfig, invariant: bool = False) -> Params:
    linear = Linear if invariant else (lambda w: w)
    blocks = []
    for i in range(c.n_layers):
        h = f"h.{i}."
        blocks.append(Block(
            t[h + "ln_1.weight"], t[h + "ln_1.bias"], linear(t[h + "attn.c_attn.weight"]), t[h + "attn.c_attn.bias"],
            linear(t[h + "attn.c_proj.weight"]), t[h + "attn.c_proj.bias"], t[h + "ln_2.weight"], t[h + "ln_2.bias"],
            linear(t[h + "mlp.c_fc.weight"]), t[h + "mlp.c_fc.bias"], linear(t[h + "mlp.c_proj.weight"]),
            t[h + "mlp.c_proj.bias"],
        ))
    head = t["wte.weight"] if c.tie_word_embeddings else t["lm_head.weight"]
    lm_head = linear(head.T)
    wte = TiedEmbedding(lm_head) if invariant and c.tie_word_embeddings else t["wte.weight"]
    return Params(wte, t["wpe.weight"], blocks, t["ln_f.weight"], t["ln_f.bias"], lm_head)


def attention_block(x: np.ndarray, b: Block, c: ModelConfig, layer: int, attend: Attend) -> np.ndarray:
    # [T, d] -> [T, d]
    T = x.shape[0]
    qkv = x @ b.c_attn_w                                     # [T, 3d]
    qkv += b.c_attn_b
    q, k, v = np.split(qkv.reshape(T, 3, c.n_heads, c.head_dim), 3, axis=1)  # each [T, 1, H, hd]
    out = attend(layer, q[:, 0], k[:, 0], v[:, 0])           # [T, H, hd]
    y = out.reshape(T, c.d_model) @ b.attn_proj_w
    y += b.attn_proj_b
    return y


def mlp(x: np.ndarray, b: Block) -> np.ndarray:
    # [T, d] -> [T, ff] -> [T, d]
    h = x @ b.c_fc_w
    h += b.c_fc_b
    y = gelu_tanh_(h) @ b.mlp_proj_w
    y += b.mlp_proj_b
    return y


def forward(p: Params, c: ModelConfig, token_ids: np.ndarray, positions: np.ndarray, attend: Attend,
            head_rows: np.ndarray | None, between_layers: BetweenLayers | None = None) -> np.ndarray:
    """[T] token ids at [T] positions -> logits [len(head_rows) or T, vocab]; `between_layers()`
    runs after every layer but the last."""
    x = p.wte[token_ids] + p.wpe[positions]                  # [T, d]
    for i, b in enumerate(p.blocks):
        x += attention_block(layer_norm(x, b.ln_1_g, b.ln_1_b, c.norm_eps), b, c, i, attend)
        x += mlp(layer_norm(x, b.ln_2_g, b.ln_2_b, c.norm_eps), b)
        if between_layers is not None and i < len(p.blocks) - 1:
            between_layers()
    if head_rows is not None:
        x = x[head_rows]
    x = layer_norm(x, p.ln_f_g, p.ln_f_b, c.norm_eps)
    return x @ p.lm_head                                     # [rows, vocab]
