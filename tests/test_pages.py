"""Page keys: a chain of BLAKE2b digests over fixed-width token ids, rooted at the fingerprint."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from worker.kv.pages import KEY_BYTES, page_key, page_keys

ROOT = bytes(range(16))


def test_only_full_pages_have_keys_and_each_key_names_its_whole_prefix():
    tokens = list(range(100, 137))  # 37 tokens: two full pages of 16 and a partial one
    keys = page_keys(ROOT, tokens, 16)
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)
    first = hashlib.blake2b(ROOT + np.asarray(tokens[:16], "<u4").tobytes(), digest_size=16).digest()
    assert keys[0] == first
    assert keys[1] == hashlib.blake2b(first + np.asarray(tokens[16:32], "<u4").tobytes(), digest_size=16).digest()
    changed = tokens.copy()
    changed[3] = 7
    other = page_keys(ROOT, changed, 16)
    assert other[0] != keys[0] and other[1] != keys[1], "a change in page 0 changes every later key"
    assert page_keys(bytes(16), tokens, 16)[0] != keys[0], "another model's fingerprint gives other keys"
    assert page_keys(ROOT, tokens, 8)[1] != keys[0]


def test_extending_a_sequence_gives_the_same_keys_as_hashing_it_whole():
    tokens = list(np.random.default_rng(0).integers(0, 50000, size=80))
    whole = page_keys(ROOT, tokens, 16)
    head = page_keys(ROOT, tokens[:35], 16)
    assert head + page_keys(ROOT, tokens, 16, start=2, parent_key=head[-1]) == whole


def test_keys_are_the_same_in_another_process():
    code = "from worker.kv.pages import page_keys; print(page_keys(bytes(range(16)), list(range(40)), 16)[1].hex())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == page_keys(ROOT, list(range(40)), 16)[1].hex()


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="parent key must be 16 bytes"):
        page_key(b"short", [1, 2])
    with pytest.raises(ValueError, match="token ids"):
        page_key(ROOT, [-1])
    with pytest.raises(ValueError, match="page_tokens"):
        page_keys(ROOT, [1], 0)
