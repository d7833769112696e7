"""A deterministic trace of prefix-sharing requests, in page-key space, for `kvcache bench eviction`.

Three kinds of request, as a chat service sees them:
- "new": a new conversation, one of a few long shared system prompts chosen with Zipf-like
  popularity (the k-th most popular comes about 1/k**s as often as the first), then a
  user message;
- "turn": the next turn of a live conversation: the previous prompt, the answer to it and
  a new user message, so every turn extends the one before;
- "one-off": a prompt that shares nothing.
Token ids come from a generator seeded with the trace's seed; page keys are made as the
worker makes them (worker.pages.page_keys), so a turn shares exactly the full pages of
the turn before it, and a trailing partial page is never shared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from worker.kv.pages import page_keys

VOCAB = 50257
ROOT = hashlib.blake2b(b"kvcache bench eviction trace", digest_size=16).digest()  # stands in for a model fingerprint


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 1000
    seed: int = 0
    page_tokens: int = 16
    system_prompts: int = 16
    system_tokens: tuple[int, int] = (256, 1024)  # length range of a shared system prompt
    zipf_s: float = 1.0  # popularity skew of the system prompts
    share_one_off: float = 0.15  # of all requests
    share_turn: float = 0.6  # of all requests, while a conversation is live
    max_live: int = 64  # conversations in flight at once
    max_turns: int = 8
    user_tokens: tuple[int, int] = (16, 128)
    answer_tokens: tuple[int, int] = (32, 256)
    one_off_tokens: tuple[int, int] = (64, 1024)
    max_prompt_tokens: int = 8192  # a conversation ends before a turn could pass this


@dataclass(frozen=True)
class Request:
    kind: str  # "new", "turn" or "one-off"
    keys: tuple[bytes, ...]  # keys of the prompt's full pages, root first
    prompt_tokens: int


@dataclass
class _Conversation:
    tokens: np.ndarray
    keys: list[bytes]
    turns_left: int


def generate(config: TraceConfig) -> list[Request]:
    """`config.requests` requests, the same ones for the same config."""
    rng = np.random.default_rng(config.seed)
    systems = [_tokens(rng, config.system_tokens) for _ in range(config.system_prompts)]
    system_keys = [page_keys(ROOT, tokens, config.page_tokens) for tokens in systems]
    popularity = 1.0 / np.arange(1, config.system_prompts + 1) ** config.zipf_s
    popularity /= popularity.sum()
    live: list[_Conversation] = []
    requests = []
    while len(requests) < config.requests:
        roll = rng.random()
        if roll < config.share_one_off:
            tokens = _tokens(rng, config.one_off_tokens)
            requests.append(Request("one-off", tuple(page_keys(ROOT, tokens, config.page_tokens)), len(tokens)))
        elif live and roll < config.share_one_off + config.share_turn:
            index = int(rng.integers(len(live)))
            requests.append(_next_turn(rng, config, live, index))
        else:
            system = int(rng.choice(config.system_prompts, p=popularity))
            tokens = np.concatenate([systems[system], _tokens(rng, config.user_tokens)])
            keys = _extend(config, tokens, list(system_keys[system]))
            requests.append(Request("new", tuple(keys), len(tokens)))
            if config.max_turns > 1 and _has_room(config, tokens):
                live.append(_Conversation(tokens, keys, config.max_turns - 1))
                if len(live) > config.max_live:
                    live.pop(0)  # the oldest conversation goes quiet
    return requests


def working_set_pages(requests: list[Request]) -> int:
    """Distinct pages in the trace: a pool this size never needs to evict."""
    return len({key for request in requests for key in request.keys})


def _next_turn(rng: np.random.Generator, config: TraceConfig, live: list[_Conversation], index: int) -> Request:
    conversation = live[index]
    added = np.concatenate([_tokens(rng, config.answer_tokens), _tokens(rng, config.user_tokens)])
    conversation.tokens = np.concatenate([conversation.tokens, added])
    conversation.keys = _extend(config, conversation.tokens, conversation.keys)
    conversation.turns_left -= 1
    if conversation.turns_left == 0 or not _has_room(config, conversation.tokens):
        live.pop(index)
    return Request("turn", tuple(conversation.keys), len(conversation.tokens))


def _has_room(config: TraceConfig, tokens: np.ndarray) -> bool:
    """Whether the longest next turn still fits in max_prompt_tokens."""
    return len(tokens) + config.answer_tokens[1] + config.user_tokens[1] <= config.max_prompt_tokens


def _extend(config: TraceConfig, tokens: np.ndarray, keys: list[bytes]) -> list[bytes]:
    """`keys` (of a prefix of `tokens`) followed by the keys of the full pages after them."""
    return keys + page_keys(ROOT, tokens, config.page_tokens, start=len(keys), parent_key=keys[-1] if keys else None)


def _tokens(rng: np.random.Generator, length_range: tuple[int, int]) -> np.ndarray:
    low, high = length_range
    return rng.integers(0, VOCAB, size=int(rng.integers(low, high + 1)), dtype=np.int64)
