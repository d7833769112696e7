"""The remote tier's fetch path: the fast float16 -> float32 cast must give NumPy's bits."""

import numpy as np
import pytest

from worker import half
from worker.half import float16_to_float32


def bits(array):
    return array.view(np.uint32 if array.dtype == np.float32 else np.uint16)


# ---- float16 -> float32 ------------------------------------------------------


def test_every_finite_half_converts_exactly_as_numpy_does():
    assert half._trick_is_exact_here()  # else the fast path is never taken and the rest proves little
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = every[np.isfinite(every)]  # subnormals, both zeros, the largest halves
    out = np.empty(finite.size, dtype=np.float32)
    float16_to_float32(finite, out)
    np.testing.assert_array_equal(bits(out), bits(finite.astype(np.float32)))


@pytest.mark.parametrize("size", [0, 1, half.CHUNK - 1, half.CHUNK, 3 * half.CHUNK + 5])
def test_infinities_and_nans_keep_their_bits_in_any_chunk(size):
    rng = np.random.default_rng(size)
    src = rng.integers(0, 65536, size=size, dtype=np.uint16).view(np.float16)  # every kind of half
    if size > half.CHUNK:
        src[half.CHUNK + 7] = np.inf
        src[2 * half.CHUNK + 1] = np.float16(np.nan)
    out = np.full(size, 7.0, dtype=np.float32)
    float16_to_float32(src, out)
    np.testing.assert_array_equal(bits(out), bits(src.astype(np.float32)))


def test_wrong_dtypes_sizes_or_layouts_are_refused():
    src = np.zeros(8, dtype=np.float16)
    with pytest.raises(ValueError, match="float16 -> float32"):
        float16_to_float32(src, np.empty(8, dtype=np.float64))
    with pytest.raises(ValueError, match="one size"):
        float16_to_float32(src, np.empty(7, dtype=np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        float16_to_float32(np.zeros(16, dtype=np.float16)[::2], np.empty(8, dtype=np.float32))
