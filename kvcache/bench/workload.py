"""The load bench's workload: a fixed, seeded list of jobs drawn from a realistic prompt mix.

Three kinds of request, each in a *family* of prompts that share a prefix:
- shared: one of a few long system prompts, picked with Zipf-like popularity (prompt i is
  chosen with weight 1/(i+1)^s), followed by a short question;
- session: a multi-turn chat; every turn's prompt is the previous turn's prompt, the model's
  reply to it and the next user message, sent with the session's id;
- unique: a one-off prompt sharing nothing with any other.

Everything is text built from a word list, so the same seed gives the same prompts on every
machine. Lengths are in characters, which are tokens for the byte-level presets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("shared", "session", "unique")

_WORDS = (
    "the a an of to in for on with as by at from cache page node worker model token prompt answer "
    "question system user assistant request latency memory store fetch compute layer attention key "
    "value prefix session turn reply order bread river city garden window winter summer music paper "
    "letter number table chair light water stone green blue quick slow small large early late open "
    "close read write send keep find show tell ask give make take bring follow explain describe "
    "compare plan build check measure improve travel history science market weather kitchen recipe"
).split()


@dataclass(frozen=True)
class WorkloadConfig:
    requests: int = 40                 # requests in the whole workload (session turns count one each)
    seed: int = 0
    mix: tuple[float, float, float] = (0.6, 0.3, 0.1)   # shares of shared / session / unique requests
    system_prompts: int = 4            # distinct shared system prompts
    zipf_s: float = 1.2                # popularity skew of the system prompts
    system_chars: int = 512            # length of each system prompt
    question_chars: tuple[int, int] = (24, 64)    # a question after a system prompt, min..max
    session_turns: int = 4             # turns per session (the last session may be cut by `requests`)
    session_context_chars: int = 256   # a session's opening context, before its first message
    turn_chars: tuple[int, int] = (24, 48)        # each user message in a session, min..max
    unique_chars: tuple[int, int] = (128, 384)    # a one-off prompt, min..max

    def check(self) -> None:
        """ValueError naming the first option out of range."""
        if self.requests < 1:
            raise ValueError(f"requests must be at least 1, got {self.requests}")
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            raise ValueError(f"the mix needs three non-negative shares (shared, session, unique), got {self.mix}")
        if self.system_prompts < 1 or self.session_turns < 1:
            raise ValueError("system prompts and session turns must be at least 1")
        if self.zipf_s < 0:
            raise ValueError(f"the Zipf exponent must be >= 0, got {self.zipf_s}")
        for name in ("question_chars", "turn_chars", "unique_chars"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= min <= max, got {low}..{high}")
        if min(self.system_chars, self.session_context_chars) < 1:
            raise ValueError("system prompt and session context lengths must be at least 1 character")

    def longest_prompt_chars(self, reply_tokens: int) -> int:
        """An upper bound on any prompt's length (before the run tag), in characters plus the
        session replies' tokens (`reply_tokens` each): the length in tokens for byte-level models."""
        labels = 48  # "S12 system prompt. ", "C3 conversation. ", "\nUser: ", "\nAssistant:" and the like
        session = (self.session_context_chars + labels + self.session_turns * (self.turn_chars[1] + labels)
                   + (self.session_turns - 1) * reply_tokens)
        return max(self.system_chars + self.question_chars[1] + 2 * labels, session, self.unique_chars[1])


@dataclass(frozen=True)
class Request:
    kind: str            # "shared", "session" or "unique"
    family: str          # requests of one family share a prefix: "system-0", "session-3", "unique-12"
    prompt: str          # the whole prompt; with follows_reply, what follows the previous turn and its reply
    session_id: str      # empty unless kind == "session"
    first_of_family: bool
    # A session turn after the first. The reply inside a session is the model's own output, as in a
    # real chat: the client sends the turn as token ids (the previous prompt's, the reply's, then the
    # new message's, tokenized alone without special tokens), so a cache that kept the reply's pages
    # can serve them. A scripted reply would be text the model never produced: a miss in any cache,
    # which no chat shows. Replies are --max-tokens long (end-of-text ignored), so both passes send
    # prompts of the same lengths and, greedy, the same tokens but for a rare rounding-tipped tie.
    follows_reply: bool = False


@dataclass(frozen=True)
class Job:
    """What one client does without pause: one request, or all turns of a session in order (a turn
    is sent after the previous one finished, as a person chatting would)."""

    requests: tuple[Request, ...]


def zipf_weights(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def build_workload(config: WorkloadConfig, tag: str = "") -> list[Job]:
    """Exactly `config.requests` requests, grouped in jobs; `tag` starts every prompt (a run id).

    Each family's number comes right after the tag, inside the first page (16 tokens) while the
    tag is short: families share no page, as unrelated prompts would not.
    """
    config.check()
    rng = np.random.default_rng(config.seed)
    systems = [f"{tag}S{i} system prompt. " + _text(rng, config.system_chars) for i in range(config.system_prompts)]
    popularity = zipf_weights(config.system_prompts, config.zipf_s)
    # The mix is in requests; a session job brings session_turns of them, so it is drawn less often.
    per_job = np.asarray(config.mix, dtype=np.float64) / (1.0, config.session_turns, 1.0)
    mix = per_job / per_job.sum()
    jobs: list[Job] = []
    seen_systems: set[int] = set()
    left = config.requests
    sessions = uniques = 0
    while left > 0:
        kind = KINDS[int(rng.choice(3, p=mix))]
        if kind == "shared":
            i = int(rng.choice(config.system_prompts, p=popularity))
            prompt = systems[i] + "\nUser: " + _text(rng, _length(rng, config.question_chars)) + "\nAssistant:"
            jobs.append(Job((Request("shared", f"system-{i}", prompt, "", i not in seen_systems),)))
            seen_systems.add(i)
            left -= 1
        elif kind == "session":
            turns = min(config.session_turns, left)
            jobs.append(Job(tuple(_session(rng, config, tag, sessions, turns))))
            sessions += 1
            left -= turns
        else:
            opening = f"{tag}U{uniques} one-off. "
            prompt = opening + _text(rng, max(1, _length(rng, config.unique_chars) - len(opening) + len(tag)))
            jobs.append(Job((Request("unique", f"unique-{uniques}", prompt, "", True),)))
            uniques += 1
            left -= 1
    return jobs


def all_requests(jobs: list[Job]) -> list[Request]:
    return [r for job in jobs for r in job.requests]


def _session(rng: np.random.Generator, config: WorkloadConfig, tag: str, number: int, turns: int) -> list[Request]:
    family = f"session-{number}"
    session_id = f"{tag}{family}"
    opening = f"{tag}C{number} conversation. " + _text(rng, config.session_context_chars)
    requests = []
    for turn in range(turns):
        message = "\nUser: " + _text(rng, _length(rng, config.turn_chars)) + "\nAssistant:"
        prompt = message if turn else opening + message
        requests.append(Request("session", family, prompt, session_id, turn == 0, follows_reply=turn > 0))
    return requests


def _length(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _text(rng: np.random.Generator, chars: int) -> str:
    """Words from the list, cut to exactly `chars` characters."""
    words = []
    total = 0
    while total < chars:
        word = _WORDS[int(rng.integers(len(_WORDS)))]
        words.append(word)
        total += len(word) + 1
    return " ".join(words)[:chars]
