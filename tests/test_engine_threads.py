"""The engine with other threads at work: a cancel never waits for a step and is never lost, a
short prompt arriving during a long prompt's chunk is computed between its layers, and several
threads submit and stream while one steps. Over the toy model of engine_helpers."""

import threading

from engine_helpers import PROMPTS, alone, make_engine


def test_cancel_returns_while_a_step_holds_the_engine_and_aborts_before_the_next():
    engine = make_engine()
    keep = engine.add_request("keep going " * 3, max_new_tokens=12)
    drop = engine.add_request("drop me " * 4, max_new_tokens=30, bypass_cache=True)
    engine.step()
    in_forward, release = threading.Event(), threading.Event()
    forward = engine.model.forward

    def blocked_forward(*args, **kwargs):
        in_forward.set()
        assert release.wait(10.0)
        return forward(*args, **kwargs)

    engine.model.forward = blocked_forward
    stepping = threading.Thread(target=engine.step)
    stepping.start()
    try:
        assert in_forward.wait(10.0)
        cancelled = threading.Event()
        threading.Thread(target=lambda: (engine.cancel(drop), cancelled.set()), daemon=True).start()
        assert cancelled.wait(10.0), "cancel waited for the step (abort() would: it takes the engine lock)"
        assert drop.completion is None and stepping.is_alive()
    finally:
        release.set()
        stepping.join(10.0)
    engine.model.forward = forward
    engine.step()
    deltas = list(drop)
    assert deltas[-1].finished and deltas[-1].completion.finish_reason == "abort"
    assert drop.request_id not in engine.live_request_ids()
    engine.cancel(drop)  # finished: nothing to do
    again = engine.add_request("drop me " * 4, max_new_tokens=3, request_id=drop.request_id)
    while engine.has_unfinished():
        engine.step()
    assert again.completion.finish_reason == "length"
    assert keep.completion.token_ids == alone("keep going " * 3, max_new_tokens=12).token_ids
    engine.pool.check_invariants()


def test_a_request_added_and_cancelled_while_a_step_starts_is_still_aborted():
    engine = make_engine()
    engine.add_request("already running", max_new_tokens=20)
    engine.step()
    late = []
    take_inbox = engine._take_inbox

    def take_then_another_thread_adds_and_cancels():
        take_inbox()
        if not late:  # between this step's look at the inbox and at the cancel queue
            late.append(engine.add_request("added then cancelled", max_new_tokens=20))
            engine.cancel(late[0])

    engine._take_inbox = take_then_another_thread_adds_and_cancels
    engine.step()
    engine._take_inbox = take_inbox
    assert late[0].completion is not None and late[0].completion.finish_reason == "abort"
    assert late[0].request_id not in engine.live_request_ids()


def arrive_during_next_forward(engine, prompt, **params):
    """Add a request from inside the next forward (as another thread would while it runs); its handle."""
    added = []
    forward = engine.model.forward

    def forward_once(batch, kv_pool, kv_dtype="float32", between_layers=None):
        engine.model.forward = forward
        added.append(engine.add_request(prompt, **params))
        return forward(batch, kv_pool, kv_dtype, between_layers)

    engine.model.forward = forward_once
    return added


def test_a_short_prompt_arriving_during_a_long_chunk_is_computed_between_its_layers():
    engine = make_engine(max_prefill_tokens=32, alone_prefill_tokens=32)
    steps = []
    engine.on_step = steps.append
    long = engine.add_request("a long prompt that is computed in chunks " * 3, max_new_tokens=5)
    engine.step()
    added = arrive_during_next_forward(engine, "short one", max_new_tokens=5)
    deltas = engine.step()
    [short] = added
    # Its first token came out of the step that was running when it arrived, before that step's own.
    assert [d.request_id for d in deltas] == [short.request_id] and len(deltas[0].token_ids) == 1
    assert [r["new"] for r in steps[-2]["requests"]] == [9] and steps[-2]["between_layers"]
    assert [r["new"] for r in steps[-1]["requests"]] == [32] and not steps[-1]["between_layers"]
    while engine.has_unfinished():
        engine.step()
    assert short.completion.token_ids == alone("short one", max_new_tokens=5).token_ids
    assert long.completion.token_ids == alone("a long prompt that is computed in chunks " * 3,
                                              max_new_tokens=5).token_ids
    engine.pool.check_invariants()
    assert engine.get_num_free_blocks() == engine.pool.num_blocks


def test_a_newcomer_no_shorter_than_the_chunk_waits_for_the_next_step():
    engine = make_engine(max_prefill_tokens=32, alone_prefill_tokens=32)
    engine.add_request("a long prompt that is computed in chunks " * 3, max_new_tokens=5)
    engine.step()
    added = arrive_during_next_forward(engine, "x" * 40, max_new_tokens=5)
    assert engine.step() == []  # the long prompt's second chunk only
    assert engine.num_waiting() == 1 and added[0].queue.empty()
    while engine.has_unfinished():
        engine.step()
    assert added[0].completion.token_ids == alone("x" * 40, max_new_tokens=5).token_ids


def test_several_threads_submit_and_stream_while_one_thread_steps():
    engine = make_engine(budget=16)
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if engine.wait_for_work(timeout=0.05):
                engine.step()

    results = {}

    def client(prompt):
        handle = engine.add_request(prompt, max_new_tokens=8)
        results[prompt] = ([t for d in handle for t in d.token_ids], handle.completion)

    stepper = threading.Thread(target=loop)
    stepper.start()
    try:
        clients = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=30)
        assert not any(c.is_alive() for c in clients)
    finally:
        stop.set()
        stepper.join(timeout=10)
    for prompt in PROMPTS:
        streamed, completion = results[prompt]
        assert streamed == completion.token_ids == alone(prompt, max_new_tokens=8).token_ids
