"""Log probabilities of tokens, from the logits a step computes anyway.

A generated token's logprob comes from the row its draw used. A prompt token's comes from the row
of the position before it, so a request that wants its prompt's logprobs (prompt_logprobs, the echo
of OpenAI's completions) has the forward return logits at every position of its prompt, and
computes every position: Request.num_reusable_pages says why it reuses no cached prefix.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from base.generation import Candidate, TokenLogprob

MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MIN_LOGPROB = -9999.0  # what a logprob of -inf is sent as (JSON has no infinity; OpenAI's and vLLM's value)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float32: the one definition of a logprob.

    Of the model's raw logits, before temperature, top-k or top-p (vLLM's "raw logprobs", what
    OpenAI's API reports), so a token's logprob does not depend on how it was drawn; tests hold
    every path (generated tokens, prompt tokens, the gateway's replies) to this function. Float32
    as on the wire (a protobuf float), so the gateway's JSON carries the number computed here."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float32))


def top_ids(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of one row, most likely first, ties by id (as `np.lexsort` orders
    them), so the same row always lists the same tokens."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    k = min(k, logprobs.size)
    candidates = np.argpartition(-logprobs, k - 1)[:k] if k < logprobs.size else np.arange(logprobs.size)
    # a tie at the k-th value: every token of that value competes, the lowest ids win
    tied = np.flatnonzero(logprobs == logprobs[candidates].min())
    candidates = np.union1d(candidates, tied)
    order = np.lexsort((candidates, -logprobs[candidates]))
    return candidates[order][:k]


def token_logprob(row: np.ndarray, token_id: int, k: int, token_bytes: Callable[[int], bytes]) -> TokenLogprob:
    """`token_id`'s logprob in one row of log-softmaxed logits, and the row's k most likely tokens."""
    def candidate(i: int) -> Candidate:
        return Candidate(int(i), max(float(row[i]), MIN_LOGPROB), token_bytes(int(i)))

    return TokenLogprob(candidate(token_id), tuple(candidate(i) for i in top_ids(row, k)))
