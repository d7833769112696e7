"""The runs of `kvcache bench determinism`: one request computed in every way the service may
compute it, each answer's tokens and the logits of each of its draws kept for comparison."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np

TARGET_SEED = 7          # every compared request draws with this seed (greedy ones ignore it)
NEIGHBOUR_SEEDS = 1000   # neighbours' seeds start here

PREAMBLE = ("A bakery's day starts before dawn. The sourdough rested overnight in the cold room; the rye "
            "needs its scald, the wheat its folds. Ovens are fired at four, the first loaves go in at five, "
            "and by six the shelves hold baguettes, seeded rolls and the dark rye the street asks for by "
            "name. Flour costs rose again this spring, so the bakery weighs every batch and keeps a ledger "
            "of waste, and the apprentice learns to shape by feel before he learns to shape fast. ")
QUESTIONS = ["What does the rye need?", "When are the ovens fired?", "Why is every batch weighed?",
             "What does the apprentice learn first?", "Which bread does the street ask for by name?",
             "Where did the sourdough rest?"]


@dataclass
class Answer:
    tokens: list[int]
    logits: np.ndarray   # [draws, vocab]: the logits each drawn token came from, in order


@contextlib.contextmanager
def recording() -> Iterator[dict]:
    """{(seed, position): logits} of every draw the engine makes meanwhile."""
    import worker.engine.engine as engine_module

    seen: dict = {}
    real = engine_module.sample

    def sample(logits, params, position, rng):
        seen[(params.seed, position)] = np.array(logits, dtype=np.float32, copy=True)
        return real(logits, params, position, rng)

    engine_module.sample = sample
    try:
        yield seen
    finally:
        engine_module.sample = real


class Runs:
    """One model, numerics and KV dtype; each method computes the target request one way."""

    def __init__(self, model, kv_dtype: str, tokens: int, node_address: str | None, seed: int = 0):
        self.model, self.kv_dtype, self.tokens, self.node = model, kv_dtype, tokens, node_address
        self.rng = np.random.default_rng(seed)
        self.vocab = min(model.config.vocab_size, 50_000)

    def engine(self, prefill_tokens: int = 1024, sequences: int = 1):
        from worker.engine.engine import Engine

        blocks = ((1024 + 2 * self.tokens) // 16 + 2) * (sequences + 2)
        return Engine(self.model, kv_dtype=self.kv_dtype, num_blocks=blocks, page_tokens=16,
                      max_num_seqs=sequences, max_num_batched_tokens=max(prefill_tokens, sequences),
                      max_prefill_tokens=prefill_tokens, alone_prefill_tokens=prefill_tokens)

    def _answer(self, engine, prompt: list[int], sampling: dict, **options) -> Answer:
        with recording() as seen:
            out = engine.generate([prompt], seed=TARGET_SEED, **self._params(sampling), **options)[0]
        return self._collect(seen, out.token_ids)

    def _params(self, sampling: dict) -> dict:
        return {"max_new_tokens": self.tokens, "ignore_eos": True, **sampling}

    @staticmethod
    def _collect(seen: dict, tokens: list[int]) -> Answer:
        keys = sorted(k for k in seen if k[0] == TARGET_SEED)
        return Answer(list(tokens), np.stack([seen[k] for k in keys]))

    def reference(self, prompt, sampling) -> Answer:
        """Alone, on a fresh engine, the prompt in one chunk."""
        return self._answer(self.engine(), prompt, sampling)

    def resumed(self, prompt, sampling, reference: Answer, k: int) -> Answer:
        """On a fresh engine after k tokens another worker sent (they are recomputed as a prompt)."""
        return self._answer(self.engine(), prompt, sampling, resumed_token_ids=reference.tokens[:k])

    def chunked(self, prompt, sampling, chunk: int) -> Answer:
        """The prompt computed in chunks of `chunk` tokens."""
        return self._answer(self.engine(prefill_tokens=chunk), prompt, sampling)

    def cached_locally(self, prompt, sampling) -> Answer:
        """Its first pages in the local prefix cache, left there by another prompt."""
        engine = self.engine()
        engine.generate([self._sharing(prompt)], max_new_tokens=1)
        return self._answer(engine, prompt, sampling)

    def fetched(self, prompt, sampling, attempts: int = 3) -> Answer:
        """Its first pages fetched from a kvnode, written there by another worker (a reader whose
        lookup missed, as one may on a loaded machine, is tried again)."""
        from worker.remote.tier import Placement, RemoteTier

        placement = Placement([self.node])
        sharing = self._sharing(prompt)
        for _ in range(attempts):
            writer = self.engine()
            writer.attach_remote_tier(tier := RemoteTier(writer.kv_pool, self.kv_dtype))
            try:
                writer.generate([sharing], max_new_tokens=1, tier_context=placement)
                if not tier.flush(timeout_s=60.0):
                    raise RuntimeError("write-back to the kvnode did not finish within 60 s")
            finally:
                tier.close()
            reader = self.engine()
            reader.attach_remote_tier(tier := RemoteTier(reader.kv_pool, self.kv_dtype, first_contact_wait_s=5.0,
                                                         lookup_timeout_s=5.0))
            try:
                answer = self._answer(reader, prompt, sampling, tier_context=placement)
            finally:
                tier.close()
            if tier.stats.pages_fetched:
                return answer
        raise RuntimeError(f"the reader fetched no page from the kvnode in {attempts} attempts")

    def batched(self, prompt, sampling, size: int) -> Answer:
        """Beside size - 1 random neighbours (prompts, lengths, sampling), half arriving with it and
        half during its run, so its steps mix prefills and decodes of others."""
        engine = self.engine(prefill_tokens=512, sequences=size)
        neighbours = [self._neighbour(i) for i in range(size - 1)]
        early, later = neighbours[:len(neighbours) // 2], neighbours[len(neighbours) // 2:]
        arrivals = sorted(((int(self.rng.integers(1, self.tokens + 1)), n) for n in later), key=lambda a: a[0])
        at = int(self.rng.integers(0, len(early) + 1))   # its place among those arriving with it
        with recording() as seen:
            handles = [engine.add_request(p, **o) for p, o in early[:at]]
            handles.append(target := engine.add_request(prompt, seed=TARGET_SEED, **self._params(sampling)))
            handles += [engine.add_request(p, **o) for p, o in early[at:]]
            step = 0
            while any(h.completion is None for h in handles):
                while arrivals and arrivals[0][0] <= step:
                    p, o = arrivals.pop(0)[1]
                    handles.append(engine.add_request(p, **o))
                engine.step()
                step += 1
        return self._collect(seen, target.completion.token_ids)

    def _neighbour(self, i: int) -> tuple[list[int], dict]:
        rng = self.rng
        n = int(rng.integers(1, 300))
        options = {"max_new_tokens": int(rng.integers(1, 2 * self.tokens)), "ignore_eos": True,
                   "seed": NEIGHBOUR_SEEDS + i, "temperature": float(rng.choice([0.0, 0.7, 1.3]))}
        return [int(t) for t in rng.integers(0, self.vocab, n)], options

    def _sharing(self, prompt: list[int]) -> list[int]:
        """Another prompt with the same first three quarters."""
        keep = len(prompt) * 3 // 4
        return prompt[:keep] + [int(t) for t in self.rng.integers(0, self.vocab, len(prompt) - keep)]


def prompts(model, count: int) -> list[list[int]]:
    """Prompts of a few hundred tokens sharing a preamble, as token ids."""
    return [list(model.tokenizer.encode(PREAMBLE + QUESTIONS[i % len(QUESTIONS)])) for i in range(count)]
