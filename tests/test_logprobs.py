"""Logprobs in the engine (worker/engine/logprobs.py): a generated token's and a prompt token's
logprob are the engine's float32 log-softmax of the model's logits at the position before it,
checked against the model recomputed from scratch (worker/model/dense.py's reference_logits); the
prompt's are complete however its prefill is cut into chunks, whatever its prefix has in the cache,
and streamed once; a resumed request neither repeats nor loses any; the bounds are refused."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.engine import Engine
from worker.engine.logprobs import MAX_LOGPROBS, MIN_LOGPROB, log_softmax, top_ids
from worker.engine.sampling import SamplingParams
from worker.model.dense import reference_logits

PROMPT = list(b"Rye, spelt and a little salt: the bakery's first loaves of the day.")
TOL = 2e-5  # paged and chunked against dense and whole: float32 sums in other orders


@pytest.fixture(scope="module")
def engine():
    return Engine.load("tiny", max_prefill_tokens=16, alone_prefill_tokens=16, page_tokens=8)


def reference(engine, ids) -> np.ndarray:
    return log_softmax(reference_logits(engine.model, ids))


def assert_candidates(engine, entry, row: np.ndarray, token: int, k: int):
    assert entry.chosen.token_id == token
    assert abs(entry.chosen.logprob - row[token]) <= TOL
    assert len(entry.top) == k
    assert [c.logprob for c in entry.top] == sorted((c.logprob for c in entry.top), reverse=True)
    for c in entry.top:
        assert abs(c.logprob - row[c.token_id]) <= TOL and c.token == engine.tokenizer.token_bytes(c.token_id)
    if k:  # the top tokens are the row's (as far as float32 sums in another order can tell)
        assert row[entry.top[-1].token_id] >= np.sort(row)[-k] - TOL


def test_log_softmax_is_float32_and_normalized():
    logits = np.random.default_rng(3).standard_normal((4, 1000)).astype(np.float32) * 8
    out = log_softmax(logits)
    assert out.dtype == np.float32
    exact = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=-1, keepdims=True))
    assert np.abs(out - exact).max() < 1e-5


def test_top_ids_are_most_likely_first_ties_by_id():
    row = np.array([0.0, -1.0, 0.5, 0.5, -3.0, 0.5], dtype=np.float32)
    assert top_ids(row, 2).tolist() == [2, 3]
    assert top_ids(row, 4).tolist() == [2, 3, 5, 0]
    assert top_ids(row, 0).tolist() == [] and top_ids(row, 99).tolist() == [2, 3, 5, 0, 1, 4]


def test_generated_tokens_logprobs_are_the_models(engine):
    [greedy] = engine.generate(PROMPT, max_new_tokens=6, logprobs=3, ignore_eos=True)
    [sampled] = engine.generate(PROMPT, max_new_tokens=6, logprobs=0, temperature=1.0, seed=7, ignore_eos=True)
    for completion, k in ((greedy, 3), (sampled, 0)):
        ids = PROMPT + completion.token_ids
        rows = reference(engine, ids)
        assert len(completion.logprobs) == len(completion.token_ids) == 6
        for i, entry in enumerate(completion.logprobs):
            assert_candidates(engine, entry, rows[len(PROMPT) - 1 + i], ids[len(PROMPT) + i], k)
    assert all(e.top[0].token_id == e.chosen.token_id for e in greedy.logprobs)   # greedy picks the top one
    assert greedy.prompt is None and engine.generate(PROMPT, max_new_tokens=2)[0].logprobs is None


def test_prompt_logprobs_are_complete_over_chunks_and_cached_prefixes(engine):
    """16-token chunks, 8-token pages; the second time the prompt's pages are all cached, yet it
    computes them all again (it needs their logits) and its pages stay cached for others."""
    rows = reference(engine, PROMPT)
    for attempt in range(2):
        [done] = engine.generate(PROMPT, max_new_tokens=1, prompt_logprobs=2)
        assert done.usage.computed_tokens == len(PROMPT) and done.usage.cached_tokens_local == 0
        assert done.prompt.token_ids == PROMPT and done.prompt.text == bytes(PROMPT).decode()
        assert len(done.prompt.logprobs) == len(PROMPT) - 1
        for p, entry in enumerate(done.prompt.logprobs):
            assert_candidates(engine, entry, rows[p], PROMPT[p + 1], 2)
    [plain] = engine.generate(PROMPT, max_new_tokens=1)
    assert plain.usage.cached_tokens_local == len(PROMPT) // 8 * 8   # what the logprob requests computed


def test_the_prompt_alone_with_max_new_tokens_0(engine):
    [alone] = engine.generate(PROMPT, max_new_tokens=0, prompt_logprobs=1, logprobs=1)
    assert alone.token_ids == [] and alone.text == "" and alone.finish_reason == "length"
    assert alone.usage.completion_tokens == 0 and alone.logprobs == []
    [echoed] = engine.generate(PROMPT, max_new_tokens=0, echo=True)
    assert echoed.prompt.token_ids == PROMPT and echoed.prompt.logprobs is None
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer .0 only with echo"):
        engine.generate(PROMPT, max_new_tokens=0)


def test_streamed_deltas_carry_their_tokens_logprobs_and_the_prompt_once(engine):
    deltas = list(engine.stream(PROMPT, max_new_tokens=5, logprobs=1, prompt_logprobs=0, ignore_eos=True))
    assert [d.prompt is not None for d in deltas] == [True] + [False] * (len(deltas) - 1)
    assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    streamed = [e for d in deltas for e in d.logprobs]
    assert streamed == deltas[-1].completion.logprobs and len(streamed) == 5
    assert all(e.top == () for e in deltas[0].prompt.logprobs)


def test_a_resumed_request_sends_only_its_new_tokens_logprobs(engine):
    [whole] = engine.generate(PROMPT, max_new_tokens=6, logprobs=2, ignore_eos=True)
    first = whole.token_ids[:2]
    deltas = list(engine.stream(PROMPT, max_new_tokens=6, logprobs=2, ignore_eos=True, resumed_token_ids=first))
    sent = [e for d in deltas for e in d.logprobs]
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids[2:]
    assert len(sent) == 4 and deltas[-1].completion.logprobs[:2] == [None, None]
    for got, want in zip(sent, whole.logprobs[2:]):
        assert got.chosen.token_id == want.chosen.token_id and abs(got.chosen.logprob - want.chosen.logprob) <= TOL


@pytest.mark.parametrize("options", [dict(logprobs=MAX_LOGPROBS + 1), dict(prompt_logprobs=-1),
                                     dict(logprobs=1.5), dict(max_new_tokens=0, logprobs=2)])
def test_bounds_are_refused_by_name(options):
    name = "max_new_tokens" if options.get("max_new_tokens") == 0 else next(iter(options))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**options)


def test_logprobs_are_finite_in_json(engine):
    """A logprob of -inf (an impossible token) is sent as OpenAI's and vLLM's -9999.0."""
    from worker.engine.logprobs import token_logprob
    row = np.array([0.0, -np.inf], dtype=np.float32)
    entry = token_logprob(row, 1, 2, lambda i: b"x")
    assert entry.chosen.logprob == MIN_LOGPROB and [c.logprob for c in entry.top] == [0.0, MIN_LOGPROB]


TEXTS = ["Hello world, naïve café: 日本語 🍞 bread!\n\tend", " leading space", "x=1;y=2  two  spaces"]


def test_token_bytes_join_to_the_text_byte_level_bpe():
    """SmolLM2's byte-level BPE: a token's bytes through GPT-2's table, a character cut between tokens."""
    from worker.model import load_model_tokenizer
    tok = load_model_tokenizer("smollm2-135m")
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == text
    assert any(not _utf8(tok.token_bytes(i)) for i in tok.encode("日本語 🍞", add_special_tokens=False))
    assert tok.token_bytes(2) == b"<|im_end|>"   # a special token: its text as written


def test_token_bytes_join_to_the_text_sentencepiece(tmp_path):
    """A SentencePiece vocabulary with byte fallback: "▁" a space, <0xNN> a byte."""
    from gguf_helpers import sentencepiece_metadata, train_sentencepiece, write_gguf
    from worker.model import load_model_tokenizer
    from worker.model.testing import llama_config, random_tensors_for
    sp = train_sentencepiece(400)
    config = llama_config(vocab_size=sp.get_piece_size(), eos_token_id=2)
    write_gguf(tmp_path / "spm.gguf", config, random_tensors_for(config, seed=41), spm=sentencepiece_metadata(sp))
    tok = load_model_tokenizer(str(tmp_path / "spm.gguf"))
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(tok.token_bytes(i) for i in ids).decode() == " " + text   # the space prefix, kept
    assert [tok.token_bytes(i) for i in tok.encode("🍞", add_special_tokens=False)][-4:] == [
        bytes([b]) for b in "🍞".encode()]


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False
