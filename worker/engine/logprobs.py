"""Log probabilities of tokens, from the logits a step computes anyway.

Design notes
1. A logprob is the engine's log-softmax of the model's raw logits at that position, in float32:
   before temperature, top-k or top-p (vLLM's "raw logprobs", what OpenAI's API reports), so a
   token's logprob does not depend on how it was drawn. `log_softmax` is the one function that
   says what they are; tests hold every path (generated tokens, prompt tokens, the gateway's
   replies) to it.
2. A generated token's logprob comes from the row its draw used. A prompt token's logprob comes
   from the row of the position before it, so a request that wants them (prompt_logprobs, the
   echo of OpenAI's completions) has the forward return logits at every position of its prompt,
   and it computes every position: it reuses no cached prefix, neither the worker's nor the
   kvnodes' (a position whose K/V came from a cache has no logits; recomputing the queries of
   cached positions would cost as much as computing them, and the model's forward would need a
   mode of its own). Its pages are still cached and written back as any request's are, so the
   requests after it reuse them. Once its prompt's logprobs are taken it is a request as any
   other: a preemption after that may reuse its pages again.
3. The most likely tokens of a position are ordered most likely first, ties by token id (as
   `np.lexsort` orders them), at most MAX_LOGPROBS of them (OpenAI's bound on top_logprobs).
4. A logprob is a float32 on the wire too (a protobuf float): the gateway's JSON carries the same
   number the engine computed.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from base.generation import Candidate, TokenLogprob

MAX_LOGPROBS = 20
MIN_LOGPROB = -9999.0  # what a logprob of -inf is sent as (JSON has no infinity; OpenAI's and vLLM's value)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax over the last axis, in float32 (design note 1)."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float32))


def top_ids(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest of one row, most likely first, ties by id (design note 3)."""
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
