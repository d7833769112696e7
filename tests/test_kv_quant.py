"""int8 and int4 KV (worker/kv/quant.py): round trips within the stated error, one token's bytes
independent of the others', the bytes a page takes."""

import numpy as np
import pytest

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
    """Computed in one prefill or one at a time, a token is stored alike (quant.py design note 1)."""
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
