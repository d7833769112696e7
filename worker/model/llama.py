"""Llama forward in NumPy: RoPE (HF's rotate_half layout), RMSNorm, SwiGLU, grouped-query attention,
tied or untied head, and q/k/v biases when the config has them (Qwen2). HF stores linear weights
[out, in]; we keep them transposed [in, out] and fuse q|k|v (and their biases) and gate|up so each
block runs three large matmuls plus the output projections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .invariant import Linear, TiedEmbedding
from .layers import Attend, BetweenLayers, rms_norm, silu_

# Buffers older Llama checkpoints carry that are recomputed from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
PREFIX = "model."


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama checkpoint must hold (names without the `model.` prefix; lm_head is top level)."""
    d, ff, hd = c.d_model, c.d_ff, c.head_dim
    shapes = {"embed_tokens.weight": (c.vocab_size, d)}
    for i in range(c.n_layers):
        pre = f"layers.{i}."
        shapes.update({
            pre + "input_layernorm.weight": (d,),
            pre + "self_attn.q_proj.weight": (c.n_heads * hd, d),
            pre + "self_attn.k_proj.weight": (c.n_kv_heads * hd, d),
            pre + "self_attn.v_proj.weight": (c.n_kv_heads * hd, d),
            **({pre + "self_attn.q_proj.bias": (c.n_heads * hd,),
                pre + "self_attn.k_proj.bias": (c.n_kv_heads * hd,),
                pre + "self_attn.v_proj.bias": (c.n_kv_heads * hd,)} if c.qkv_bias else {}),
            pre + "self_attn.o_proj.weight": (d, c.n_heads * hd),
            pre + "post_attention_layernorm.weight": (d,),
            pre + "mlp.gate_proj.weight": (ff, d),
            pre + "mlp.up_proj.weight": (ff, d),
            pre + "mlp.down_proj.weight": (d, ff),
        })
    shapes["norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, d)
    return shapes


# Weight matrices are arrays [in, out], or Linear (the same, with batch-invariant rows) when invariant.
@dataclass
class Block:
    attn_norm: np.ndarray    # [d]
    w_qkv: np.ndarray        # [d, (H + 2 KV) hd]
    w_o: np.ndarray          # [H hd, d]
    mlp_norm: np.ndarray     # [d]
    w_gate_up: np.ndarray    # [d, 2 ff]
    w_down: np.ndarray       # [ff, d]
    b_qkv: np.ndarray | None = None   # [(H + 2 KV) hd]; None: no bias to add (Llama)


@dataclass
class Params:
    embed: np.ndarray        # [vocab, d] (rows read from lm_head when tied and invariant)
    blocks: list[Block]
    norm: np.ndarray         # [d]
    lm_head: np.ndarray      # [d, vocab]: embed.T when tied
    inv_freq: np.ndarray     # [hd / 2] float64 RoPE frequencies (after any scaling)


def build_params(t: dict[str, np.ndarray], c: ModelConfig, invariant: bool = False) -> Params:
    linear = Linear if invariant else (lambda w: w)
    blocks = []
    for i in range(c.n_layers):
        pre = f"layers.{i}."
        attn, mlp_ = pre + "self_attn.", pre + "mlp."
        blocks.append(Block(
            attn_norm=t[pre + "input_layernorm.weight"],
            w_qkv=linear(np.concatenate([t[attn + "q_proj.weight"].T, t[attn + "k_proj.weight"].T,
                                         t[attn + "v_proj.weight"].T], axis=1)),
            w_o=linear(np.ascontiguousarray(t[attn + "o_proj.weight"].T)),
            mlp_norm=t[pre + "post_attention_layernorm.weight"],
            w_gate_up=linear(np.concatenate([t[mlp_ + "gate_proj.weight"].T, t[mlp_ + "up_proj.weight"].T], axis=1)),
            w_down=linear(np.ascontiguousarray(t[mlp_ + "down_proj.weight"].T)),
            b_qkv=np.concatenate([t[attn + "q_proj.bias"], t[attn + "k_proj.bias"],
                                  t[attn + "v_proj.bias"]]) if c.qkv_bias else None,
        ))
    head = t["embed_tokens.weight"] if c.tie_word_embeddings else t["lm_head.weight"]
    lm_head = linear(head.T)
    embed = TiedEmbedding(lm_head) if invariant and c.tie_word_embeddings else t["embed_tokens.weight"]
    return Params(embed, blocks, t["norm.weight"], lm_head, rope_inv_freq(c))


def rope_inv_freq(c: ModelConfig) -> np.ndarray:
    """Rotation frequency of each pair of dimensions, with the config's RoPE scaling applied."""
    inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim))
    s = c.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    if s["rope_type"] == "llama3":  # transformers' _compute_llama3_parameters
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled)
    raise AssertionError(f"rope_type {s['rope_type']!r} should have been refused by the config reader")


def rope_tables(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # [T] -> cos, sin [T, 1, hd/2] (angles in float64, tables in float32)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(angles).astype(np.float32)[:, None, :], np.sin(angles).astype(np.float32)[:, None, :]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    # [T, heads, hd] -> [T, heads, hd]; HF layout: dimension i pairs with i + hd/2 (rotate_half).
    # The products go straight into the output halves (one temporary instead of four); each
    # element is still x1 cos - x2 sin and x2 cos + x1 sin, rounded as before.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty(x.shape, dtype=x.dtype)
    lo, hi = out[..., :half], out[..., half:]
    np.multiply(x1, cos, out=lo)
    tmp = np.multiply(x2, sin)
    lo -= tmp
    np.multiply(x2, cos, out=hi)
    np.multiply(x1, sin, out=tmp)
    hi += tmp
    return out


def attention_block(x, b: Block, c: ModelConfig, layer: int, attend: Attend, cos, sin) -> np.ndarray:
    # [T, d] -> [T, d]
    T, H, KV, hd = x.shape[0], c.n_heads, c.n_kv_heads, c.head_dim
    qkv = x @ b.w_qkv                                        # [T, (H + 2KV) hd]
    if b.b_qkv is not None:
        qkv += b.b_qkv
    qk = apply_rope(qkv[:, :(H + KV) * hd].reshape(T, H + KV, hd), cos, sin)   # q and k in one pass
    q, k = qk[:, :H], qk[:, H:]
    v = qkv[:, (H + KV) * hd:].reshape(T, KV, hd)
    out = attend(layer, q, k, v)                             # [T, H, hd]
    return out.reshape(T, H * hd) @ b.w_o


def mlp(x: np.ndarray, b: Block, c: ModelConfig) -> np.ndarray:
    # [T, d] -> [T, 2ff] -> [T, d]  (SwiGLU)
    gate_up = x @ b.w_gate_up
    h = silu_(gate_up[:, : c.d_ff])
    h *= gate_up[:, c.d_ff:]
    return h @ b.w_down


def forward(p: Params, c: ModelConfig, token_ids: np.ndarray, positions: np.ndarray, attend: Attend,
            head_rows: np.ndarray | None, between_layers: BetweenLayers | None = None) -> np.ndarray:
    """[T] token ids at [T] positions -> logits [len(head_rows) or T, vocab]; `between_layers()`
    runs after every layer but the last."""
    cos, sin = rope_tables(p.inv_freq, positions)
    x = p.embed[token_ids]                                   # [T, d]
    for i, b in enumerate(p.blocks):
        x += attention_block(rms_norm(x, b.attn_norm, c.norm_eps), b, c, i, attend, cos, sin)
        x += mlp(rms_norm(x, b.mlp_norm, c.norm_eps), b, c)
        if between_layers is not None and i < len(p.blocks) - 1:
            between_layers()
    if head_rows is not None:
        x = x[head_rows]
    x = rms_norm(x, p.norm, c.norm_eps)
    return x @ p.lm_head                                     # [rows, vocab]
