"""The engine under faults and misuse: duplicate request ids, a step that fails for one request,
and resumed requests that must end exactly as an uninterrupted run would (StepRunner._run_isolated,
Engine.add_request)."""

import threading

import pytest

from engine_helpers import PROMPTS, ToyModel, alone, make_engine
from worker.engine.engine import Engine
from worker.engine.outputs import RequestIdInUse

POISON = ord("#")


class PoisonedModel(ToyModel):
    """Its forward raises whenever a batch holds the poison token, as a bug in the model would."""

    def forward(self, batch, kv_pool, kv_dtype="float32", between_layers=None):
        if POISON in batch.token_ids.tolist():
            raise FloatingPointError("injected fault")
        return super().forward(batch, kv_pool, kv_dtype, between_layers)


def _engine(model) -> Engine:
    return Engine(model, num_blocks=64, page_tokens=8, max_num_seqs=8, max_num_batched_tokens=256, seed=0)


def _step_until_done(engine, handles, max_steps=500):
    for _ in range(max_steps):
        if all(h.completion is not None for h in handles):
            return [h.completion for h in handles]
        engine.step()
    raise AssertionError("requests did not finish")


def test_the_same_id_added_from_many_threads_at_once_is_taken_once():
    engine = make_engine()
    barrier = threading.Barrier(8)
    handles, refused = [], []

    def add():
        barrier.wait(5.0)
        try:
            handles.append(engine.add_request(PROMPTS[0], request_id="dup", max_new_tokens=6))
        except RequestIdInUse as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5.0)
    assert len(handles) == 1 and len(refused) == 7
    assert "'dup' is already in use" in refused[0]
    [done] = _step_until_done(engine, handles)
    assert done.token_ids == alone(PROMPTS[0], max_new_tokens=6).token_ids
    assert engine.live_request_ids() == [] and engine.num_running() == 0 and engine.num_waiting() == 0


def test_an_id_is_free_again_once_its_request_finished_or_was_aborted():
    engine = make_engine()
    first = engine.add_request(PROMPTS[1], request_id="same", max_new_tokens=3)
    with pytest.raises(RequestIdInUse):
        engine.add_request(PROMPTS[2], request_id="same", max_new_tokens=3)
    _step_until_done(engine, [first])
    second = engine.add_request(PROMPTS[2], request_id="same", max_new_tokens=3)
    assert engine.abort("same")
    assert second.completion.finish_reason == "abort"
    third = engine.add_request(PROMPTS[2], request_id="same", max_new_tokens=3)
    assert _step_until_done(engine, [third])[0].token_ids == alone(PROMPTS[2], max_new_tokens=3).token_ids


def test_a_forward_that_fails_for_one_request_fails_only_that_one():
    engine = _engine(PoisonedModel())
    prompts = [PROMPTS[0], "poisoned # prompt", PROMPTS[3], PROMPTS[1]]
    handles = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    done = _step_until_done(engine, handles)
    assert done[1].finish_reason == "error" and "injected fault" in done[1].error
    for prompt, completion in zip(prompts, done):
        if completion is not done[1]:
            assert completion.finish_reason == "length"
            assert completion.token_ids == alone(prompt, max_new_tokens=8).token_ids
    assert engine.get_num_free_blocks() == engine.pool.num_blocks  # the failed request's blocks were freed too
    later = engine.add_request(PROMPTS[2], max_new_tokens=4)  # the engine goes on serving
    assert _step_until_done(engine, [later])[0].token_ids == alone(PROMPTS[2], max_new_tokens=4).token_ids


def test_a_failure_after_the_forward_fails_only_its_request(monkeypatch):
    engine = make_engine()
    decode = engine.tokenizer.decode

    def fragile_decode(ids):
        if POISON in ids:
            raise UnicodeError("injected decode fault")
        return decode(ids)

    monkeypatch.setattr(engine.tokenizer, "decode", fragile_decode)
    handles = [engine.add_request(p, max_new_tokens=5) for p in (PROMPTS[0], "bad #", PROMPTS[1])]
    done = _step_until_done(engine, handles)
    assert done[1].finish_reason == "error" and "injected decode fault" in done[1].error
    assert [d.finish_reason for d in (done[0], done[2])] == ["length", "length"]
    assert done[0].token_ids == alone(PROMPTS[0], max_new_tokens=5).token_ids


def _stream(engine, prompt, **options):
    handle = engine.add_request(prompt, **options)
    deltas = []
    while handle.completion is None:
        engine.step()
    while not handle.queue.empty():
        deltas.append(handle.queue.get())
    return deltas


@pytest.mark.parametrize("ending", ["length", "stop string", "stop token"])
def test_a_request_resumed_after_any_token_ends_as_the_uninterrupted_one(ending):
    prompt = PROMPTS[0]
    reference = alone(prompt, max_new_tokens=14)
    options = {"max_new_tokens": 14}
    if ending == "stop string":  # three characters from the middle of the text: held back, then cut
        options["stop"] = (reference.text[5:8],)
    elif ending == "stop token":
        options["stop_token_ids"] = (reference.token_ids[6],)
    deltas = _stream(make_engine(), prompt, **options)
    tokens = [t for d in deltas for t in d.token_ids]
    full_text = "".join(d.text for d in deltas)
    final = deltas[-1].completion
    assert final.finish_reason == ("length" if ending == "length" else "stop")
    sent_tokens, sent_text = [], ""
    for delta in [None, *deltas]:  # resume after every delta that reached the client
        if delta is not None:
            sent_tokens += delta.token_ids
            sent_text += delta.text
        rest = _stream(make_engine(), prompt, resumed_token_ids=sent_tokens, **options)
        assert sent_tokens + [t for d in rest for t in d.token_ids] == tokens
        assert sent_text + "".join(d.text for d in rest) == full_text
        resumed = rest[-1].completion
        assert (resumed.finish_reason, resumed.token_ids, resumed.text) == (final.finish_reason, tokens, final.text)
        assert resumed.usage.prompt_tokens == final.usage.prompt_tokens
        assert resumed.usage.completion_tokens == len(tokens)


def test_resumed_tokens_past_the_request_end_are_refused():
    reference = alone(PROMPTS[1], max_new_tokens=4)
    with pytest.raises(ValueError, match="after the request ended"):
        make_engine().add_request(PROMPTS[1], max_new_tokens=4, resumed_token_ids=reference.token_ids + [97])
    with pytest.raises(ValueError, match="resumed token ids must be in"):
        make_engine().add_request(PROMPTS[1], max_new_tokens=4, resumed_token_ids=[10**6])
