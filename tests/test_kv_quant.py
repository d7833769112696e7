"""int8 and int4 KV (worker/kv/quant.py): round trips within the stated error, one token's bytes
independent of the others', the bytes a page takes."""

import numpy as np
import pytest

from worker.kv import quant
from worker.kv.quant import kv_codec, storage_dtype

HEAD_DIM = 64


def keys_like(rng, n):
    """Keys with per-channel offsets and a few large channels, as RoPE'd keys have."""
    x = rng.standard_normal((n, HEAD_DIM)).astype(np.float32)
    x += rng.standard_normal(HEAD_DIM).astype(np.float32) * 4
    x[:, [3, 40]] *= 20
    return x


def bound(x, fmt):
    """Half a step of the token's group (its scale), plus float16's rounding of scale and minimum."""
    g = x.reshape(len(x), -1, fmt.group)
    if fmt.minimum:
        step = (g.max(-1) - g.min(-1)) / (2**fmt.bits - 1)
    else:
        step = np.abs(g).max(-1) / (2 ** (fmt.bits - 1) - 1)
    big = np.abs(g).max(-1)
    return np.repeat(0.5 * step * (1 + 2**-9) + big * 2**-10, fmt.group, axis=1)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("part", ["k", "v"])
def test_round_trips_within_half_a_step(kv_dtype, part):
    codec = kv_codec(kv_dtype, HEAD_DIM)
    fmt = codec.key if part == "k" else codec.value
    x = keys_like(np.random.default_rng(1), 500)
    err = np.abs(codec.round_trip(x, part) - x)
    assert (err <= bound(x, fmt)).all(), float((err - bound(x, fmt)).max())
    rel = np.linalg.norm(codec.round_trip(x, part) - x) / np.linalg.norm(x)   # with channels 20x the rest
    assert rel < (0.02 if kv_dtype == "int8" else 0.2)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_encode_decode_through_page_bytes(kv_dtype):
    """K and V of [tokens, heads] encoded into a token's bytes and decoded from strided rows, as the pool's."""
    codec = kv_codec(kv_dtype, HEAD_DIM)
    rng = np.random.default_rng(2)
    k, v = keys_like(rng, 48).reshape(16, 3, HEAD_DIM), rng.standard_normal((16, 3, HEAD_DIM)).astype(np.float32)
    raw = codec.encode(k, v)
    assert raw.shape == (16, 3, codec.token_bytes) and raw.dtype == np.uint8
    keys, values = np.empty((48, HEAD_DIM), np.float32), np.empty((48, HEAD_DIM), np.float32)
    codec.decode_keys(raw.reshape(48, -1), keys)
    codec.decode_values(raw.reshape(48, -1), values)
    np.testing.assert_array_equal(keys.reshape(k.shape), codec.round_trip(k, "k"))
    np.testing.assert_array_equal(values.reshape(v.shape), codec.round_trip(v, "v"))


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_a_tokens_bytes_do_not_depend_on_the_others(kv_dtype):
    """Computed in one prefill or one at a time, a token is stored alike (per-token scales: worker/kv/quant.py)."""
    codec = kv_codec(kv_dtype, HEAD_DIM)
    rng = np.random.default_rng(3)
    k, v = keys_like(rng, 20), keys_like(rng, 20)
    together = codec.encode(k, v)
    alone = np.concatenate([codec.encode(k[i:i + 1], v[i:i + 1]) for i in range(20)])
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_zeros_come_back_exactly_and_constant_groups_within_the_bound(kv_dtype):
    codec = kv_codec(kv_dtype, HEAD_DIM)
    x = np.zeros((3, HEAD_DIM), np.float32)
    x[1] = 0.5
    x[2, :32] = -3.0
    for part, fmt in (("k", codec.key), ("v", codec.value)):
        back = codec.round_trip(x, part)
        np.testing.assert_array_equal(back[0], 0.0)
        np.testing.assert_array_equal(back[2, 32:], 0.0)
        assert (np.abs(back - x) <= bound(x, fmt)).all()


def test_bytes_a_token_and_pages_per_gib_against_float16():
    int8, int4 = kv_codec("int8", HEAD_DIM), kv_codec("int4", HEAD_DIM)
    assert int8.token_bytes == 2 * (64 + 2)            # codes and one float16 scale, K and V
    assert int4.token_bytes == (32 + 4 * 4) + (32 + 2 * 2)   # K: scales and minimums of 16 channels; V: scales of 32
    float16 = 2 * HEAD_DIM * 2
    assert float16 / int8.token_bytes >= 1.9
    assert float16 / int4.token_bytes >= 3.0
    assert storage_dtype("int4") == np.uint8 and storage_dtype("float16") == np.float16
    assert kv_codec("float16", HEAD_DIM) is None
    assert kv_codec("int4", 48).value.group == 16 and kv_codec("int8", 16).key.group == 16   # groups that divide
    with pytest.raises(ValueError, match="even head_dim"):
        kv_codec("int4", 15)


def reference_encode(fmt, x):
    """A token's bytes by the quantization arithmetic spelled out, one step at a time."""
    hd = x.shape[-1]
    xg = x.reshape(len(x), hd // fmt.group, fmt.group)
    big = np.float32(65504.0)
    if fmt.minimum:
        levels = 2**fmt.bits - 1
        lo16 = np.clip(xg.min(-1, keepdims=True), -big, big).astype(np.float16)
        scale16 = np.minimum((xg.max(-1, keepdims=True) - lo16.astype(np.float32)) / levels, big).astype(np.float16)
        scale = scale16.astype(np.float32)
        codes = np.clip(np.rint((xg - lo16.astype(np.float32)) / np.where(scale == 0, 1, scale)), 0, levels)
        meta = [scale16[..., 0], lo16[..., 0]]
    else:
        qmax = 2 ** (fmt.bits - 1) - 1
        scale16 = np.minimum(np.abs(xg).max(-1, keepdims=True) / qmax, big).astype(np.float16)
        scale = scale16.astype(np.float32)
        codes = np.clip(np.rint(xg / np.where(scale == 0, 1, scale)), -qmax, qmax) + (8 if fmt.bits == 4 else 0)
        meta = [scale16[..., 0]]
    codes = codes.reshape(len(x), hd).astype(np.int8).view(np.uint8)
    if fmt.bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return np.concatenate([codes] + [m.view(np.uint8) for m in meta], axis=1)


def reference_decode(fmt, raw, hd):
    """What a token's bytes stand for: code * scale (+ minimum) in float32, channel by channel."""
    code_bytes, groups = hd * fmt.bits // 8, hd // fmt.group
    if fmt.bits == 4:
        nibbles = raw[:, :code_bytes].astype(np.int16)
        codes = np.stack([nibbles & 15, nibbles >> 4], axis=-1).reshape(len(raw), hd).astype(np.float32)
        codes -= 0 if fmt.minimum else 8
    else:
        codes = raw[:, :code_bytes].view(np.int8).astype(np.float32)
    halves = raw[:, code_bytes:].copy().view(np.float16).astype(np.float32)
    scale = np.repeat(halves[:, :groups], fmt.group, axis=1)
    out = codes * scale
    return out + np.repeat(halves[:, groups:], fmt.group, axis=1) if fmt.minimum else out


@pytest.mark.parametrize("kv_dtype,head_dim", [("int8", 64), ("int8", 16), ("int4", 64), ("int4", 48)])
def test_encode_and_decode_are_the_arithmetic_spelled_out_bit_for_bit(kv_dtype, head_dim, monkeypatch):
    """Encode and decode against the arithmetic spelled out: every bit, for keys as a model makes
    them, awkward groups (zeros, constants, tiny and huge values) and any bytes at all (NaN and
    infinite scales, -0 minimums) read from strided rows, decoded a slice of rows at a time."""
    monkeypatch.setattr(quant, "DECODE_ROWS", 64)
    codec = kv_codec(kv_dtype, head_dim)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, head_dim)).astype(np.float32) * rng.uniform(0.01, 30, (300, 1)).astype(np.float32)
    x[:20] = 0
    x[20:40] = rng.choice([-3.0, -0.0, 1e-8, -1e-8, 0.5, 7e4, -1e6, np.inf, -np.inf, np.nan], (20, head_dim))
    x[40:60, :16] = 2.5
    k, v = x[:150], x[150:]
    with np.errstate(invalid="ignore", over="ignore"):
        raw = codec.encode(k, v)
        np.testing.assert_array_equal(raw[:, :codec.key_bytes], reference_encode(codec.key, k))
        np.testing.assert_array_equal(raw[:, codec.key_bytes:], reference_encode(codec.value, v))
        anything = rng.integers(0, 256, (400, codec.token_bytes), dtype=np.uint8)
        special = np.array([0x8000, 0, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 1, 0x83FF, 0x7BFF], np.uint16)  # -0, inf, NaN...
        key_codes, value_codes = (head_dim * fmt.bits // 8 for fmt in (codec.key, codec.value))
        for a, b in ((key_codes, codec.key_bytes), (codec.key_bytes + value_codes, codec.token_bytes)):
            anything[:100, a:b] = rng.choice(special, (100, (b - a) // 2)).view(np.uint8)
        for rows in (raw, anything):
            for decode, fmt, part in ((codec.decode_keys, codec.key, rows[:, :codec.key_bytes]),
                                      (codec.decode_values, codec.value, rows[:, codec.key_bytes:])):
                out = np.empty((len(rows), head_dim), np.float32)
                decode(rows, out)
                np.testing.assert_array_equal(out.view(np.uint32), reference_decode(fmt, part, head_dim).view(np.uint32))
