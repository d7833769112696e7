"""Traces in Mooncake's format (FAST'25 release, kvcache-ai/Mooncake `FAST25-release/traces/`):
one JSON object a line, `timestamp` (ms from the start), `input_length` and `output_length`
(tokens), `hash_ids` (the prompt as a chain of blocks of 512 tokens, each block an integer;
equal ids mean an equal block with an equal prefix, so a request's ids are a path in a
prefix tree).

Each id becomes one page key (16 bytes, the id big-endian), its parent the id before it in
the request. Every block holds 512 tokens but the last, which holds what is left of
input_length.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvnode.store.page_store import KEY_BYTES

BLOCK_TOKENS = 512


class TraceError(ValueError):
    """The file is not a trace in Mooncake's format; says which line and why."""


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: int
    keys: tuple[bytes, ...]  # one per block, root first
    block_tokens: tuple[int, ...]  # tokens in each block: BLOCK_TOKENS but the last
    prompt_tokens: int


def page_key(hash_id: int) -> bytes:
    return hash_id.to_bytes(KEY_BYTES, "big")


def read_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Every request of the file, in its order; TraceError on the first line that is not one."""
    requests = []
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(parse_request(line, block_tokens, f"{path}:{number}"))
    if not requests:
        raise TraceError(f"{path} holds no request")
    return requests


def parse_request(line: str, block_tokens: int, where: str) -> TraceRequest:
    try:
        fields = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    if not isinstance(fields, dict):
        raise TraceError(f"{where}: not a JSON object")
    for name in ("timestamp", "input_length", "hash_ids"):
        if name not in fields:
            raise TraceError(f"{where}: no {name!r} field")
    ids, length, timestamp = fields["hash_ids"], fields["input_length"], fields["timestamp"]
    if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < 2 ** (8 * KEY_BYTES) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of non-negative integers")
    if len(set(ids)) != len(ids):
        raise TraceError(f"{where}: hash_ids repeats a block")
    if type(length) is not int or math.ceil(length / block_tokens) != len(ids):
        raise TraceError(f"{where}: input_length {length!r} does not fill {len(ids)} blocks of {block_tokens} tokens")
    if not isinstance(timestamp, (int, float)) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of milliseconds")
    tokens = (block_tokens,) * (len(ids) - 1) + (length - block_tokens * (len(ids) - 1),)
    return TraceRequest(int(timestamp), tuple(page_key(i) for i in ids), tokens, length)


def unique_pages(requests: list[TraceRequest]) -> int:
    return len({key for request in requests for key in request.keys})


def infinite_cache_hits(requests: list[TraceRequest]) -> tuple[int, int]:
    """(blocks, tokens) a cache that never evicts serves as cached prefix: the ceiling at 100%."""
    seen: set[bytes] = set()
    blocks = tokens = 0
    for request in requests:
        hits = 0
        while hits < len(request.keys) and request.keys[hits] in seen:
            hits += 1
        blocks += hits
        tokens += sum(request.block_tokens[:hits])
        seen.update(request.keys)
    return blocks, tokens
