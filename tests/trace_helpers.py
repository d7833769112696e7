"""A small trace in Mooncake's format, written by the tests themselves: multi-turn chats that
extend their previous turn, a few shared system prompts, and one-off prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

BLOCK = 512


def write_trace(path: Path, requests: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [fresh(rng.randint(1, 4)) for _ in range(4)]
    chats: list[list[int]] = []
    lines = []
    for n in range(requests):
        roll = rng.random()
        if roll < 0.2:
            ids = fresh(rng.randint(1, 12))
        elif roll < 0.7 and chats:
            chat = rng.choice(chats)
            chat[-1:] = fresh(rng.randint(2, 4))  # the last, partial block changes as the chat grows
            ids = list(chat)
        else:
            ids = rng.choice(systems) + fresh(rng.randint(1, 3))
            chats.append(list(ids))
        length = BLOCK * (len(ids) - 1) + rng.randint(1, BLOCK)
        lines.append(json.dumps({"timestamp": 250 * n, "input_length": length, "output_length": rng.randint(1, 200),
                                 "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path
