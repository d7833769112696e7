"""Page keys: content addresses of full pages, deterministic across processes and machines.

A page's key is the 16-byte BLAKE2b digest of its parent page's key followed by its token ids
as fixed-width little-endian unsigned 32-bit ints. The first page's parent is the model
fingerprint (architecture, weights, KV dtype, page size), so a key names a page's whole prefix
and KV of different models never mix. A tenant's namespace (base/tokens.py) is mixed into that
root, so the same prompt from two tenants has unrelated keys on every tier.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from base.pages import KEY_BYTES

TOKEN_DTYPE = np.dtype("<u4")  # vocabularies stay far below 2**32


def tenant_root(fingerprint: bytes, namespace: str) -> bytes:
    """The root of a tenant's key chain: the fingerprint itself for the shared namespace ("")."""
    if not namespace:
        return fingerprint
    digest = hashlib.blake2b(b"kvcache tenant\0", digest_size=KEY_BYTES)
    digest.update(fingerprint)
    digest.update(namespace.encode())
    return digest.digest()


def page_key(parent_key: bytes, page_token_ids: Sequence[int]) -> bytes:
    """Key of one full page whose parent's key (or, for the first page, the fingerprint) is `parent_key`."""
    if len(parent_key) != KEY_BYTES:
        raise ValueError(f"parent key must be {KEY_BYTES} bytes, got {len(parent_key)}")
    ids = np.asarray(page_token_ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must be between 0 and 2**32 - 1")
    digest = hashlib.blake2b(parent_key, digest_size=KEY_BYTES)
    digest.update(ids.astype(TOKEN_DTYPE).tobytes())
    return digest.digest()


def page_keys(root: bytes, token_ids: Sequence[int], page_tokens: int, start: int = 0,
              parent_key: bytes | None = None) -> list[bytes]:
    """Keys of the full pages of `token_ids` (a trailing partial page has none).

    With `start` > 0 the keys of pages `start`, `start + 1`, ... are returned; `parent_key`
    must then be the key of page `start - 1` (this lets a growing sequence extend its keys).
    """
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    parent = root if start == 0 else parent_key
    if parent is None:
        raise ValueError("page_keys from a later page needs the key of the page before it")
    keys = []
    for page in range(start, len(token_ids) // page_tokens):
        parent = page_key(parent, token_ids[page * page_tokens:(page + 1) * page_tokens])
        keys.append(parent)
    return keys
