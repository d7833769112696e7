"""NumPy building blocks shared by the model families (float32 in, float32 out).

Scalars are Python floats: a NumPy float64 scalar times a float32 array gives float64 (slow).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from ..kv.quant import kv_codec

# attend(layer, q [T, n_heads, hd], k [T, n_kv_heads, hd], v [T, n_kv_heads, hd]) -> [T, n_heads, hd]:
# stores the new keys/values wherever the caller keeps its cache and attends over the whole context.
Attend = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]

# between_layers(): called by a forward after each layer but the last. The engine uses it to
# compute a newly arrived short prompt while a long prompt's chunk is half-way through its layers.
BetweenLayers = Callable[[], None]

_GELU_C = math.sqrt(2.0 / math.pi)


def layer_norm(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    # [T, d] -> [T, d]
    xc = x - x.mean(axis=-1, keepdims=True)
    var = np.mean(xc * xc, axis=-1, keepdims=True)
    xc *= 1.0 / np.sqrt(var + eps)
    xc *= g
    xc += b
    return xc


def rms_norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    # [T, d] -> [T, d]
    ms = np.mean(x * x, axis=-1, keepdims=True)
    out = x * (1.0 / np.sqrt(ms + eps))
    out *= g
    return out


def gelu_tanh_(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh-approximated GELU, in place: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    t = x * x
    t *= x
    t *= 0.044715
    t += x
    t *= _GELU_C
    np.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    x *= t
    return x


def silu_(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), in place."""
    s = np.negative(x)
    np.exp(s, out=s)
    s += 1.0
    x /= s
    return x


def round_kv(x: np.ndarray, kv_dtype: str, part: str = "k") -> np.ndarray:
    """Keys (part "k") or values ("v") [..., head_dim] as attention reads them once stored: float16 KV is
    rounded the moment it is computed (docs/architecture.md), int8 and int4 KV quantized then
    (worker/kv/quant.py), so a page fetched from a node is bit-identical to one computed here."""
    if kv_dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    codec = kv_codec(kv_dtype, x.shape[-1])
    return x if codec is None else codec.round_trip(x, part)
