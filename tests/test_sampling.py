"""Sampling: greedy, temperature, top-k, top-p, seeds by position, and stop conditions."""

import numpy as np
import pytest

from worker.engine.sampling import FINISH_LENGTH, FINISH_STOP, SamplingParams, StopChecker, sample
from worker.model.tokenizer import ByteTokenizer


LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.2, 0.05]))


def draws(params, positions, rng=None):
    rng = rng or np.random.default_rng(123)
    return [sample(LOGITS, params, p, rng) for p in positions]


def test_greedy_takes_the_argmax():
    assert draws(SamplingParams(), range(5)) == [1] * 5
    assert draws(SamplingParams(temperature=1.0, top_k=1), range(5)) == [1] * 5


def test_a_seeded_draw_depends_only_on_seed_and_position():
    params = SamplingParams(temperature=1.0, seed=7)
    forward = draws(params, range(200))
    backward = draws(params, reversed(range(200)), rng=np.random.default_rng(999))[::-1]
    assert forward == backward
    assert forward != draws(SamplingParams(temperature=1.0, seed=8), range(200))
    assert len(set(forward)) > 2


def test_temperature_draws_follow_the_distribution():
    counts = np.bincount(draws(SamplingParams(temperature=1.0, seed=1), range(4000)), minlength=5) / 4000
    assert np.allclose(counts, np.exp(LOGITS), atol=0.03)


def test_top_k_and_top_p_cut_the_tail():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2, seed=3), range(500))) == {1, 2}
    # 0.4 + 0.3 = 0.7 reaches top_p 0.65: tokens 1 and 2 only
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.65, seed=3), range(500))) == {1, 2}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.75, seed=3), range(500))) == {1, 2, 3}


@pytest.mark.parametrize("bad", [dict(max_new_tokens=0), dict(temperature=-1.0), dict(temperature=float("nan")),
                                 dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-3), dict(stop=("",))])
def test_bad_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def feed(checker, text_or_ids):
    ids = list(text_or_ids.encode()) if isinstance(text_or_ids, str) else list(text_or_ids)
    pieces = []
    for n, token in enumerate(ids, 1):
        reason = checker.append(token, n, 10 + n)
        pieces.append(checker.take_text_delta())
        if reason:
            return reason, pieces, n
    return None, pieces, len(ids)


def test_a_stop_string_ends_the_text_before_it_and_is_never_streamed():
    checker = StopChecker(ByteTokenizer(), SamplingParams(max_new_tokens=100, stop=("END", "zz")), [1, 2], [256], 1000)
    reason, pieces, n = feed(checker, "hello ENand END more")
    assert reason == FINISH_STOP and n == len("hello ENand END")
    assert checker.text == "hello ENand " and "".join(pieces) == "hello ENand "


def test_stop_tokens_eos_and_max_new_tokens():
    tok = ByteTokenizer()
    checker = StopChecker(tok, SamplingParams(max_new_tokens=100), [], [256], 1000)
    assert feed(checker, [104, 105, 256, 106])[0::2] == (FINISH_STOP, 3)
    assert checker.text == "hi"
    checker = StopChecker(tok, SamplingParams(max_new_tokens=100, stop_token_ids=(105,)), [], [256], 1000)
    assert feed(checker, [104, 105, 106])[0::2] == (FINISH_STOP, 2)
    checker = StopChecker(tok, SamplingParams(max_new_tokens=100, ignore_eos=True), [], [256], 1000)
    assert feed(checker, [104, 256, 105])[0::2] == (None, 3)
    checker = StopChecker(tok, SamplingParams(max_new_tokens=100), [], [256, 120], 1000)
    assert feed(checker, [104, 120, 105])[0::2] == (FINISH_STOP, 2), "any end-of-text id stops"
    checker = StopChecker(tok, SamplingParams(max_new_tokens=100, ignore_eos=True), [], [256, 120], 1000)
    assert feed(checker, [104, 120, 256, 105])[0::2] == (None, 4)
    checker = StopChecker(tok, SamplingParams(max_new_tokens=3), [], [256], 1000)
    assert feed(checker, "abcdef")[0::2] == (FINISH_LENGTH, 3)
    assert checker.text == "abc"


def test_a_character_split_across_tokens_is_emitted_whole():
    checker = StopChecker(ByteTokenizer(), SamplingParams(max_new_tokens=100), [], [256], 1000)
    _, pieces, _ = feed(checker, "aé€b")
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) == "aé€b"


def test_invalid_utf8_is_emitted_as_replacement_characters_without_waiting_forever():
    checker = StopChecker(ByteTokenizer(), SamplingParams(max_new_tokens=100), [], [256], 1000)
    _, pieces, _ = feed(checker, [0xFF] * 10 + list(b"ok"))
    assert "".join(pieces).endswith("ok") and "".join(pieces).count("\ufffd") == 10
