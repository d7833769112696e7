"""Sampling parameters, the next-token draw, and stop conditions (tokens, strings, lengths).

A draw depends on the logits, the request's parameters and, when it is seeded, on its seed and the
token's position: never on what else runs in the batch. Text is handed out as it becomes complete
and only once no stop string can cut it any more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from worker.engine.logprobs import MAX_LOGPROBS

# Bounds on what a client may ask (each stop string is searched for after every token).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256

FINISH_STOP = "stop"      # an end-of-text or stop token, or a stop string
FINISH_LENGTH = "length"  # max_new_tokens, or the model's (or pool's) maximum length
FINISH_ABORT = "abort"    # the caller aborted the request
FINISH_ERROR = "error"    # the engine failed on this request (it failed alone; the rest went on)
MAX_PENDING_TOKENS = 6    # a character never spans more tokens; past this, U+FFFD is real (invalid UTF-8)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0          # 0 is greedy
    top_k: int = 0                    # 0 keeps every token
    top_p: float = 1.0                # nucleus: smallest set of tokens whose probability reaches top_p
    seed: int | None = None           # None draws from the engine's generator (not reproducible)
    stop: tuple[str, ...] = ()        # stop strings; the text ends before the first one
    stop_token_ids: tuple[int, ...] = field(default=())  # finish after any of these (and after end-of-text)
    ignore_eos: bool = False          # keep going past the end-of-text token
    # Logprobs (worker/engine/logprobs.py): each new token's, with this many most likely tokens beside it
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # each prompt token's after the first (its whole prompt is computed)
    echo: bool = False                # hand the prompt back (its ids and text) with the first token

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        prompt_back = self.echo or self.prompt_logprobs is not None
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < (0 if prompt_back else 1):
            raise ValueError(f"max_new_tokens must be a positive integer (0 only with echo or prompt_logprobs: "
                             f"the prompt alone), got {self.max_new_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens "
                                 f"given beside each token), or None for none, got {value!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop[:MAX_STOP_STRINGS]!r}")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters, "
                             f"got {len(self.stop)} of up to {max(map(len, self.stop))}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids must be >= 0, got {self.stop_token_ids[:5]!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def sample(logits: np.ndarray, params: SamplingParams, position: int, rng: np.random.Generator) -> int:
    """Draw the token at `position` from one row of logits [vocab].

    A seeded draw uses a generator seeded from (seed, position), so the same seed gives the same
    text whatever else runs in the batch, and a request resumed on another worker goes on as it
    would have. Unseeded requests draw from the engine's generator (`rng`)."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / float(params.temperature)
    if 0 < params.top_k < scaled.size:
        candidates = np.argpartition(-scaled, params.top_k - 1)[:params.top_k]
    else:
        candidates = np.arange(scaled.size)
    candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]  # most likely first, ties by id
    probs = np.exp(scaled[candidates] - scaled[candidates[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    if params.seed is not None:
        rng = np.random.default_rng([params.seed, position])
    # Walk the kept tokens in id order, not probability order: logits that differ in the last bits
    # (another batch shape, float16 KV) then change a draw only when it falls right at a boundary,
    # never because two near-equal tokens swapped places.
    order = np.argsort(candidates)
    candidates, probs = candidates[order], probs[order]
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(candidates[min(index, len(candidates) - 1)])


class StopChecker:
    """Follows one request's new tokens: decides when it finishes and what text it has produced.

    Text is decoded incrementally (vLLM's prefix and read offsets): each token decodes a short
    window of ids and only what is new and complete is kept, never the U+FFFD of a character whose
    bytes are still coming. Text that may yet begin a stop string is held back (take_text_delta),
    so a stream never shows text the final answer does not contain."""

    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: Sequence[int],
                 eos_token_ids: Sequence[int], max_total_tokens: int):
        """`eos_token_ids`: the model's end-of-text ids (its eos and any further ones its
        metadata lists, as Llama 3's end-of-turn); any of them ends the text unless ignore_eos."""
        self.tokenizer = tokenizer
        self.params = params
        self.max_total_tokens = max_total_tokens
        self.stop_token_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_token_ids.update(eos_token_ids)
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._ids = list(prompt_token_ids[-6:])  # a little context so the first word decodes as it would mid-text
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._num_emitted = 0
        self._num_searched = 0
        self.finish_reason: str | None = None

    def append(self, token_id: int, num_new_tokens: int, num_total_tokens: int) -> str | None:
        """Take the newest token; returns the finish reason once the request is done."""
        if token_id in self.stop_token_ids:
            self.finish_reason = FINISH_STOP
            self._flush()
            return self.finish_reason
        self._ids.append(token_id)
        self._decode_step()
        if self._find_stop_string():
            self.finish_reason = FINISH_STOP
        elif num_new_tokens >= self.params.max_new_tokens or num_total_tokens > self.max_total_tokens:
            self.finish_reason = FINISH_LENGTH
            self._flush()
        return self.finish_reason

    def finish(self, reason: str) -> None:
        """End early (an abort): whatever is decoded so far is the text."""
        self.finish_reason = reason
        self._flush()

    def take_text_delta(self) -> str:
        """Text not yet handed out that can no longer be cut by a stop string."""
        end = len(self.text) if self.finish_reason else max(len(self.text) - self._holdback, self._num_emitted)
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def _decode_step(self) -> None:
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self.tokenizer.decode(self._ids[self._prefix_offset:])
        incomplete = new_text.endswith("\ufffd") and len(self._ids) - self._read_offset < MAX_PENDING_TOKENS
        if len(new_text) > len(prefix_text) and not incomplete:
            self.text += new_text[len(prefix_text):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def _flush(self) -> None:
        """At the end, take even an incomplete character (as U+FFFD)."""
        if self._read_offset < len(self._ids):
            prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
            self.text += self.tokenizer.decode(self._ids[self._prefix_offset:])[len(prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)

    def _find_stop_string(self) -> bool:
        if not self.params.stop:
            return False
        start = max(0, self._num_searched - self._holdback)
        cut = min((i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0), default=-1)
        self._num_searched = len(self.text)
        if cut < 0:
            return False
        self.text = self.text[:cut]
        return True
