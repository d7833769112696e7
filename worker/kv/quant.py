"""int8 and int4 KV: each token's key and value quantized once, when computed, with their scales.

Per token, in groups of channels: a token's K (or V) of one head is split into groups of channels,
each with its own float16 scale (and, for int4 keys, a float16 minimum). A token's bytes then
depend on its own K/V alone, as float16's rounding does: a fetched page is the bytes its writer
computed, and a page computed in one prefill or a token at a time is stored alike. (Keys scaled per
channel over a page, as KIVI does, would let a query see its own open page otherwise than a later
query sees it full; docs/benchmarks-log.md has the trial.)

int8: keys and values symmetric, one scale per head. int4: keys asymmetric (a key group's values
often share a sign) in groups of 16 channels, values symmetric in groups of 32. The KV dtype's name
stands for its grouping in the fingerprint.

Page layout, layer-major so the layer-wise fill's bands still hold: [layer, kv_head, token, K bytes
then V bytes]; a token's K bytes are its codes (int4: two a byte, low nibble first), then its groups'
scales, then (int4 keys) their minimums, float16 little-endian. The value a code stands for is
code * scale (+ minimum) in float32, the same arithmetic everywhere (`round_trip` too).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

_FLOAT16_MAX = np.float32(65504.0)
DECODE_ROWS = 8192   # rows TokenFormat.decode converts at a time


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
        """x [..., hd] float32 -> out [..., nbytes] uint8. A decode step encodes one token a layer, so
        what counts is the number of NumPy calls: few temporaries, reused in place."""
        hd = x.shape[-1]
        groups, code_bytes = hd // self.group, hd * self.bits // 8
        xg = x.reshape(*x.shape[:-1], groups, self.group).astype(np.float32, copy=False)
        halves = out[..., code_bytes:].view(np.float16)   # the groups' scales, then their minimums
        if self.minimum:
            high = np.float32(2**self.bits - 1)
            lo = np.minimum.reduce(xg, axis=-1)
            lo16 = np.minimum(np.maximum(lo, -_FLOAT16_MAX, out=lo), _FLOAT16_MAX, out=lo).astype(np.float16)
            np.copyto(lo, lo16)   # the stored minimum, in float32
            span = np.maximum.reduce(xg, axis=-1)
            span -= lo
            span /= high
            scale16 = np.minimum(span, _FLOAT16_MAX, out=span).astype(np.float16)
            halves[..., groups:] = lo16
            codes, low = xg - lo[..., None], np.float32(0)
        else:
            high = np.float32(2 ** (self.bits - 1) - 1)
            amax = np.maximum.reduce(np.abs(xg), axis=-1)
            amax /= high
            scale16 = np.minimum(amax, _FLOAT16_MAX, out=amax).astype(np.float16)
            codes, low = xg.copy(), -high
        halves[..., :groups] = scale16
        scale = scale16.astype(np.float32)
        if np.count_nonzero(scale) < scale.size:
            scale[scale == 0] = 1   # a zero scale divides by 1
        codes /= scale[..., None]
        np.rint(codes, out=codes)
        np.minimum(np.maximum(codes, low, out=codes), high, out=codes)
        if self.bits == 8:
            np.copyto(out[..., :code_bytes].view(np.int8), codes.reshape(*x.shape[:-1], hd), casting="unsafe")
            return
        if not self.minimum:
            codes += 8   # a nibble holds code + 8
        pairs = codes.reshape(*x.shape[:-1], hd).astype(np.uint8).view(np.uint16)   # (low, high) little-endian
        np.copyto(out[..., :code_bytes], pairs | (pairs >> 4), casting="unsafe")    # low nibble first

    # ---- decode ---------------------------------------------------------------

    def decode(self, raw: np.ndarray, out: np.ndarray) -> None:
        """raw [n, nbytes] uint8 (rows may be strided) -> out [n, hd] float32 (C-contiguous), in slices
        of DECODE_ROWS: a batch's whole gather at once, with temporaries several times its size, ran
        out of the caches."""
        for start in range(0, len(out), DECODE_ROWS):
            self._decode(raw[start:start + DECODE_ROWS], out[start:start + DECODE_ROWS])

    def _decode(self, raw: np.ndarray, out: np.ndarray) -> None:
        """Every product runs over whole rows: the scales are repeated over their channels first, since
        NumPy's broadcasting of one scale over a group of 16 or 32 channels costs more than that."""
        n, hd = out.shape
        groups, code_bytes = hd // self.group, hd * self.bits // 8
        if raw.strides[-1] != 1:
            raw = np.ascontiguousarray(raw)
        flat = out.reshape(-1)
        if self.bits == 8:   # a cast, then the product: a mixed-type product runs slower
            np.copyto(out, raw[:, :code_bytes].view(np.int8))
        else:
            np.copyto(out, _nibbles(raw[:, :code_bytes], signed=not self.minimum))
        per_channel = self._per_channel(raw[:, code_bytes:], groups)
        np.multiply(flat, per_channel[0], out=flat)
        if self.minimum:
            np.add(flat, per_channel[1], out=flat)

    def _per_channel(self, halves: np.ndarray, groups: int) -> np.ndarray:
        """Rows' float16 scales (then minimums), [n, groups (+ groups)] -> float32 [1 (or 2), n * hd]:
        each repeated over its group's channels. Copied out one item a row, then one table lookup."""
        bits = np.ascontiguousarray(halves.view(f"V{2 * groups}").T)   # [scales (, minimums), n]
        per_group = np.take(_HALF_TO_FLOAT, bits.view(np.uint16), mode="clip")
        return np.repeat(per_group, self.group).reshape(len(bits), -1)


def _nibbles(packed: np.ndarray, signed: bool) -> np.ndarray:
    """int4 codes [n, b] (two a byte, low nibble first) -> [n, 2b], one a byte (signed: minus 8, int8).
    A byte widened to 16 bits and spread is its two nibbles as little-endian bytes."""
    pairs = packed.astype(np.uint16)
    np.bitwise_or(pairs, np.left_shift(pairs, _FOUR), out=pairs)
    np.bitwise_and(pairs, _LOW_NIBBLES, out=pairs)
    codes = pairs.view(np.uint8)
    if signed:
        np.subtract(codes, _EIGHT, out=codes)
        return codes.view(np.int8)
    return codes


_FOUR, _EIGHT, _LOW_NIBBLES = np.uint16(4), np.uint8(8), np.uint16(0x0F0F)
# float16 bits -> float32: a table, exactly NumPy's cast (which runs element by element here)
_HALF_TO_FLOAT = np.arange(2**16, dtype=np.uint16).view(np.float16).astype(np.float32)


@dataclass(frozen=True)
class KVCodec:
    """A quantized KV dtype for one head size: a token's K then V bytes."""

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
