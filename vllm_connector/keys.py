"""Keys of vLLM's blocks in kvcache: one page per block and layer, chained so a node's prefix rules hold.

A block's key chains like the worker's pages (worker/kv/pages.py): the digest of the previous block's
key and the block's token ids, the first block's parent being the root. The root mixes the
fingerprint (model, dtype, block size, KV layout, vLLM version) with the request's cache_salt, so
blocks of another layout or tenant never match. Page (block b, layer l) has the parent page
(b, l - 1), and (b, 0) has (b - 1, last layer): a block's last-layer page being cached means every
page before it is (a kvnode keeps only pages whose parent it holds, and evicts only leaves).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Sequence

from base.pages import KEY_BYTES
from worker.kv.pages import page_key, tenant_root


@dataclass(frozen=True)
class BlockLayout:
    """What makes two engines' blocks interchangeable byte for byte: a fingerprint of all of it roots every key."""

    model: str            # the model's name or path as the engine was given it, or the user's model_id
    model_config: str     # the model's config as text: weights of another shape never match
    kv_dtype: str         # e.g. "torch.bfloat16"
    block_size: int       # tokens per block
    num_layers: int
    num_kv_heads: int
    head_size: int
    page_bytes: int       # one layer's block: one kvcache page
    platform: str         # "cpu", "cuda" ...: the attention backend, and so the bytes' tiling, follows it
    engine_version: str   # vLLM's version: its kernels' tiling may change between releases

    def fingerprint(self) -> bytes:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.blake2b(b"kvcache vllm blocks\0" + text.encode(), digest_size=KEY_BYTES).digest()


def block_keys(fingerprint: bytes, cache_salt: str, token_ids: Sequence[int], block_size: int,
               num_blocks: int) -> list[bytes]:
    """Keys of the first `num_blocks` full blocks of `token_ids`."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} tokens need {num_blocks * block_size} token ids, "
                         f"got {len(token_ids)}")
    keys, parent = [], tenant_root(fingerprint, cache_salt)
    for b in range(num_blocks):
        parent = page_key(parent, token_ids[b * block_size:(b + 1) * block_size])
        keys.append(parent)
    return keys


def layer_page_key(block_key: bytes, layer: int) -> bytes:
    return hashlib.blake2b(block_key + layer.to_bytes(4, "little"), digest_size=KEY_BYTES).digest()


def block_pages(block_key: bytes, previous_block_key: bytes | None, num_layers: int) -> tuple[list[bytes], list[bytes]]:
    """(keys, parents) of one block's pages, layer 0 first; the first block's first page has no parent (b"")."""
    keys = [layer_page_key(block_key, layer) for layer in range(num_layers)]
    first_parent = b"" if previous_block_key is None else layer_page_key(previous_block_key, num_layers - 1)
    return keys, [first_parent] + keys[:-1]


def last_layer_keys(block_keys_: Sequence[bytes], num_layers: int) -> list[bytes]:
    """What a lookup asks for: a block's last page cached means the whole chain up to it is."""
    return [layer_page_key(key, num_layers - 1) for key in block_keys_]
