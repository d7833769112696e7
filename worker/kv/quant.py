"""int8 and int4 KV: each token's key and value quantized once, when computed, with their scales.

Design notes
1. Per token, in groups of channels: a token's K (or V) of one head is split into groups of
   channels, each with its own float16 scale (and, for int4 keys, its float16 minimum). A token's
   bytes depend on its own K/V alone, as float16's rounding does: a fetched page is the bytes its
   writer computed, a page's tokens read the same open or full, and a page computed in one
   prefill or a token at a time differs only where the forward's floats do; no open page is kept
   aside. Keys per channel over a page (KIVI) scored better in int4 (0.6% against 2.1% more
   perplexity, docs/benchmarks-log.md) but a query would then see its own open page otherwise than
   a later query sees it full, so pages computed in decode and in prefill would differ.
2. int8: keys and values symmetric, one scale for a head's 64 channels: 66 bytes a token-head,
   1.94x float16's pages per GiB. int4: keys asymmetric (scale and minimum: a key group's
   values often share a sign) in groups of 16 channels, values symmetric in groups of 32:
   48 + 36 bytes a token-head, 3.05x float16's. The grouping is the fingerprint's (the KV dtype's name).
3. Page layout (layer-major, so the layer-wise fill's bands still hold): [layer, kv_head, token,
   K bytes then V bytes]; a token's K bytes are its codes (int4: two a byte, low nibble first),
   then its groups' scales, then (int4 keys) their minimums, float16 little-endian.
4. Decoding goes into the float32 attention reads: the value a token's code stands for is
   code * scale (+ minimum) in float32, the same arithmetic everywhere (`round_trip` too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

_FLOAT16_MAX = np.float32(65504.0)


@dataclass(frozen=True)
class TokenFormat:
    """How one token's K or V of one head is stored: `bits` a channel, `group` channels a scale."""

    bits: int
    group: int
    minimum: bool  # asymmetric: a float16 minimum per group too (codes 0..2**bits - 1)

    def nbytes(self, head_dim: int) -> int:
        groups = head_dim // self.group
        return head_dim * self.bits // 8 + groups * 2 * (2 if self.minimum else 1)

    # ---- encode ---------------------------------------------------------------

    def encode(self, x: np.ndarray, out: np.ndarray) -> None:
        """x [..., hd] float32 -> out [..., nbytes] uint8."""
        hd = x.shape[-1]
        groups = hd // self.group
        xg = x.reshape(*x.shape[:-1], groups, self.group).astype(np.float32, copy=False)
        if self.minimum:
            lo = xg.min(axis=-1, keepdims=True)
            hi = xg.max(axis=-1, keepdims=True)
            levels = 2**self.bits - 1
            lo16 = np.clip(lo, -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)
            scale16 = np.minimum((hi - lo16.astype(np.float32)) / levels, _FLOAT16_MAX).astype(np.float16)
            scale = scale16.astype(np.float32)
            codes = np.rint((xg - lo16.astype(np.float32)) / np.where(scale == 0, 1, scale))
            codes = np.clip(codes, 0, levels).astype(np.uint8)
            meta = np.concatenate([scale16[..., 0], lo16[..., 0]], axis=-1)
        else:
            qmax = 2 ** (self.bits - 1) - 1
            scale16 = np.minimum(np.abs(xg).max(axis=-1, keepdims=True) / qmax, _FLOAT16_MAX).astype(np.float16)
            scale = scale16.astype(np.float32)
            codes = np.clip(np.rint(xg / np.where(scale == 0, 1, scale)), -qmax, qmax)
            codes = (codes + (8 if self.bits == 4 else 0)).astype(np.int8).view(np.uint8)  # int4: nibble = code + 8
            meta = scale16[..., 0]
        codes = codes.reshape(*x.shape[:-1], hd)
        code_bytes = hd * self.bits // 8
        if self.bits == 4:
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[..., :code_bytes] = codes
        out[..., code_bytes:] = np.ascontiguousarray(meta).view(np.uint8)

    # ---- decode ---------------------------------------------------------------

    def decode(self, raw: np.ndarray, out: np.ndarray) -> None:
        """raw [n, nbytes] uint8 (rows may be strided) -> out [n, hd] float32 (C-contiguous)."""
        n, hd = out.shape
        groups = hd // self.group
        code_bytes = hd * self.bits // 8
        meta = np.ascontiguousarray(raw[:, code_bytes:]).view(np.float16).astype(np.float32)[:, :, None]
        scale = meta[:, :groups]   # [n, groups, 1]; then the minimums (int4 keys)
        og = out.reshape(n, groups, self.group)
        if self.bits == 8:   # a cast, then the scales (one mixed-type multiply ran 3x slower here)
            np.copyto(og, raw[:, :code_bytes].view(np.int8).reshape(n, groups, self.group))
        else:                # a byte's two codes at once: a table of float32 pairs seen as 8-byte items
            lut = _PAIRS_UNSIGNED if self.minimum else _PAIRS_SIGNED
            np.take(lut, raw[:, :code_bytes], out=out.view(np.uint64), mode="clip")
        og *= scale
        if self.minimum:
            og += meta[:, groups:]


# byte -> (low nibble, high nibble) as float32: int4 codes, unsigned (asymmetric) or minus 8 (symmetric)
_NIBBLES = np.stack([np.arange(256) & 15, np.arange(256) >> 4], axis=1).astype(np.float32)
_PAIRS_UNSIGNED = np.ascontiguousarray(_NIBBLES).view(np.uint64).reshape(256)
_PAIRS_SIGNED = np.ascontiguousarray(_NIBBLES - 8).view(np.uint64).reshape(256)


@dataclass(frozen=True)
class KVCodec:
    """A quantized KV dtype for one head size: a token's K then V bytes (design notes 2, 3)."""

    name: str
    head_dim: int
    key: TokenFormat
    value: TokenFormat

    @property
    def key_bytes(self) -> int:
        return self.key.nbytes(self.head_dim)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V of one head."""
        return self.key_bytes + self.value.nbytes(self.head_dim)

    def encode(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """k, v [..., hd] float32 -> [..., token_bytes] uint8."""
        out = np.empty((*k.shape[:-1], self.token_bytes), dtype=np.uint8)
        self.key.encode(k, out[..., : self.key_bytes])
        self.value.encode(v, out[..., self.key_bytes:])
        return out

    def decode_keys(self, raw: np.ndarray, out: np.ndarray) -> None:
        """raw [n, token_bytes] -> keys [n, hd] float32."""
        self.key.decode(raw[:, : self.key_bytes], out)

    def decode_values(self, raw: np.ndarray, out: np.ndarray) -> None:
        self.value.decode(raw[:, self.key_bytes:], out)

    def round_trip(self, x: np.ndarray, part: str) -> np.ndarray:
        """What attention reads for keys (part "k") or values ("v") x [..., hd]: decode(encode(x))."""
        fmt = self.key if part == "k" else self.value
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, self.head_dim)
        raw = np.empty((len(flat), fmt.nbytes(self.head_dim)), dtype=np.uint8)
        fmt.encode(flat, raw)
        out = np.empty(flat.shape, dtype=np.float32)
        fmt.decode(raw, out)
        return out.reshape(x.shape)


_FORMATS = {
    "int8": (TokenFormat(8, 64, False), TokenFormat(8, 64, False)),
    "int4": (TokenFormat(4, 16, True), TokenFormat(4, 32, False)),
}


def kv_codec(kv_dtype: str, head_dim: int) -> KVCodec | None:
    """The codec of a quantized KV dtype (None for float32 and float16). A group that does not divide
    the head is halved until it does (a 16-wide head: int8 groups of 16); an odd head is refused."""
    if kv_dtype not in _FORMATS:
        return None
    if head_dim % 2:
        raise ValueError(f"{kv_dtype} KV needs an even head_dim, got {head_dim}")
    key, value = (replace(fmt, group=_divisor(fmt.group, head_dim)) for fmt in _FORMATS[kv_dtype])
    return KVCodec(kv_dtype, head_dim, key, value)


def _divisor(group: int, head_dim: int) -> int:
    while head_dim % group:
        group //= 2
    return group


def token_bytes(kv_dtype: str, head_dim: int) -> int:
    """Bytes of one token's K and V of one head in `kv_dtype`, scales included."""
    codec = kv_codec(kv_dtype, head_dim)
    return 2 * head_dim * np.dtype(kv_dtype).itemsize if codec is None else codec.token_bytes


def page_sizes(block_shape: tuple[int, ...], kv_dtype: str) -> dict[str, int]:
    """The bytes of a page of the same model in each KV dtype, from a pool's block shape in `kv_dtype`
    (so a worker can say which KV dtype a kvnode of another page size was started for)."""
    if len(block_shape) != (4 if kv_dtype in _FORMATS else 5):
        return {}   # not an engine's pool
    if kv_dtype in _FORMATS:
        layers, kv_heads, page_tokens, held = block_shape
        head_dim = next((h for h in range(2, 2 * held, 2) if token_bytes(kv_dtype, h) == held), None)
    else:
        layers, _, kv_heads, page_tokens, head_dim = block_shape
    if head_dim is None:
        return {}
    return {dtype: layers * kv_heads * page_tokens * token_bytes(dtype, head_dim)
            for dtype in ("float32", "float16", *_FORMATS)}


def storage_dtype(kv_dtype: str) -> np.dtype:
    """The dtype of a pool and of pages on the wire: float32, float16, or bytes for int8 and int4."""
    return np.dtype(np.uint8) if kv_dtype in _FORMATS else np.dtype(kv_dtype)
