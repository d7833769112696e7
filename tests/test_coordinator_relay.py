"""The coordinator's relay core without gRPC: which worker failures are retried elsewhere,
which mark a worker dead, which end the call, and the ids and deadlines attempts get."""

from __future__ import annotations

import pytest
from grpc import StatusCode

from coordinator.membership import NODE, WORKER, Membership
from coordinator.relay import AttemptFailed, ClientCall, Refused, Relay
from coordinator.router import Router
from protos import kvcache_pb2 as pb

GIB = 2**30
W1, W2, W3 = "127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:1003"


class FakeWorkers:
    """Per worker a list of behaviours, one per attempt: a list of token ids to stream (then
    finish), or an AttemptFailed to raise (after `tokens_first` tokens, if given). A request with
    echo gets its prompt ([1, 2, 3]) on the first message, with logprobs each token its own."""

    def __init__(self, **plans):
        self.plans = {address: list(plan) for address, plan in plans.items()}
        self.attempts: list[tuple[str, pb.GenerateRequest, float]] = []

    def open(self, worker, request, timeout, call):
        copy = pb.GenerateRequest()
        copy.CopyFrom(request)
        self.attempts.append((worker, copy, timeout))
        plan = self.plans[worker].pop(0)
        tokens, failure = (plan, None) if isinstance(plan, list) else (plan.tokens_first, plan)
        prompt = request.echo
        for token in tokens:
            yield reply(request, [token], prompt)
            prompt = False
        if prompt and (failure is None or failure.prompt_first):  # the prompt alone (max_tokens 0)
            yield reply(request, [], True)
        if failure is not None:
            raise failure
        yield pb.GenerateReply(finish_reason="length",
                               usage=pb.Usage(prompt_tokens=5,  # a worker counts resumed tokens as its own
                                              completion_tokens=len(request.resume_token_ids) + len(tokens)))

    def workers_tried(self) -> list[str]:
        return [worker for worker, _, _ in self.attempts]


def reply(request: pb.GenerateRequest, tokens: list[int], prompt: bool) -> pb.GenerateReply:
    def logprob(token: int) -> pb.TokenLogprob:
        return pb.TokenLogprob(chosen=pb.Candidate(token_id=token, logprob=-token / 8, token=f"<{token}>".encode()))

    message = pb.GenerateReply(text="".join(f"<{t}>" for t in tokens), token_ids=tokens)
    if request.HasField("logprobs"):
        message.logprobs.extend(logprob(t) for t in tokens)
    if prompt:
        message.prompt_token_ids.extend([1, 2, 3])
        message.prompt_text = "hello"
        if request.HasField("prompt_logprobs"):
            message.prompt_logprobs.extend([logprob(2), logprob(3)])
    return message


def failed(code: StatusCode, details: str = "", tokens_first=(), draining: bool = False,
           prompt_first: bool = False) -> AttemptFailed:
    failure = AttemptFailed(code, details, draining)
    failure.tokens_first = list(tokens_first)
    failure.prompt_first = prompt_first  # with echo and no tokens first: the prompt was sent
    return failure


def client_call(remaining: float | None = None, active: bool = True) -> ClientCall:
    return ClientCall(lambda: remaining, lambda: active, lambda callback: True)


def relay_for(fakes: FakeWorkers, workers=(W1, W2), request_timeout_s: float = 600.0) -> tuple[Relay, Membership]:
    membership = Membership()
    membership.register(NODE, "127.0.0.1:2001", GIB)
    for address in workers:
        membership.register(WORKER, address)
    return Relay(membership, Router(), fakes.open, 1, 64, request_timeout_s), membership


def run(relay: Relay, call: ClientCall | None = None, **fields) -> tuple[list[int], pb.GenerateReply]:
    request = pb.GenerateRequest(prompt="hello", max_tokens=4, **fields)
    tokens, last = [], None
    for reply in relay.generate(request, call or client_call()):
        tokens.extend(reply.token_ids)
        last = reply
    return tokens, last


def alive_workers(membership: Membership) -> list[str]:
    return sorted(m.address for m in membership.live(WORKER))


def test_a_busy_worker_is_skipped_and_stays_alive():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.RESOURCE_EXHAUSTED, "no room for another stream")],
                           W2: [[1, 2, 3, 4]]})
    relay, membership = relay_for(fakes)
    tokens, last = run(relay)
    assert tokens == [1, 2, 3, 4] and last.finish_reason == "length"
    assert fakes.workers_tried() == [W1, W2]
    assert alive_workers(membership) == [W1, W2]


def test_every_worker_busy_is_resource_exhausted_not_unavailable():
    busy = failed(StatusCode.RESOURCE_EXHAUSTED, "no room for another stream")
    fakes = FakeWorkers(**{W1: [busy], W2: [busy]})
    relay, membership = relay_for(fakes)
    with pytest.raises(Refused) as refused:
        run(relay)
    assert refused.value.code == StatusCode.RESOURCE_EXHAUSTED
    assert "all workers are busy" in refused.value.message and "retry" in refused.value.message
    assert alive_workers(membership) == [W1, W2]


def test_a_busy_worker_after_tokens_is_resumed_elsewhere_without_losing_a_token():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.RESOURCE_EXHAUSTED, "pool full", tokens_first=[7, 8])],
                           W2: [[9, 10]]})
    relay, _ = relay_for(fakes)
    tokens, last = run(relay)
    assert tokens == [7, 8, 9, 10]
    resumed = fakes.attempts[1][1]
    assert list(resumed.resume_token_ids) == [7, 8] and resumed.max_tokens == 4  # the request's own
    assert last.usage.prompt_tokens == 5 and last.usage.completion_tokens == 4


@pytest.mark.parametrize("tokens_first, rest, max_tokens", [([7, 8], [9, 10], 4), ([], [], 0)])
def test_a_resumed_stream_neither_repeats_nor_loses_logprobs_nor_the_prompt(tokens_first, rest, max_tokens):
    """Logprobs ride with their tokens; the prompt (echo) goes out once, the second worker's copy
    dropped, and a message left with nothing else in it dropped whole (the prompt alone)."""
    fakes = FakeWorkers(**{W1: [failed(StatusCode.UNAVAILABLE, "connection reset", tokens_first, prompt_first=True)],
                           W2: [rest]})
    relay, _ = relay_for(fakes)
    request = pb.GenerateRequest(prompt="hello", max_tokens=max_tokens, echo=True, logprobs=1, prompt_logprobs=0)
    replies = list(relay.generate(request, client_call()))
    assert [list(r.prompt_token_ids) for r in replies if r.prompt_token_ids] == [[1, 2, 3]]
    assert [e.chosen.token_id for e in replies[0].prompt_logprobs] == [2, 3]
    tokens = [t for r in replies for t in r.token_ids]
    assert tokens == tokens_first + rest == [e.chosen.token_id for r in replies for e in r.logprobs]
    assert [len(r.logprobs) for r in replies] == [len(r.token_ids) for r in replies]
    assert replies[-1].finish_reason == "length" and fakes.workers_tried() == [W1, W2]
    assert list(fakes.attempts[1][1].resume_token_ids) == tokens_first and fakes.attempts[1][1].echo


def test_an_unreachable_worker_is_marked_dead_and_the_request_goes_elsewhere():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.UNAVAILABLE, "failed to connect")], W2: [[1, 2, 3, 4]]})
    relay, membership = relay_for(fakes)
    assert run(relay)[0] == [1, 2, 3, 4]
    assert alive_workers(membership) == [W2]


def test_a_worker_shutting_down_is_skipped_but_not_marked_dead():
    shutting_down = failed(StatusCode.UNAVAILABLE, "this worker is shutting down: send it elsewhere", draining=True)
    fakes = FakeWorkers(**{W1: [shutting_down], W2: [[1, 2, 3, 4]]})
    relay, membership = relay_for(fakes)
    assert run(relay)[0] == [1, 2, 3, 4]
    assert alive_workers(membership) == [W1, W2]


def test_shutting_down_is_told_by_the_trailer_not_by_the_message():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.UNAVAILABLE, "shutting down, says the proxy")], W2: [[1, 2]]})
    relay, membership = relay_for(fakes)
    assert run(relay)[0] == [1, 2]
    assert alive_workers(membership) == [W2]


@pytest.mark.parametrize("code", [StatusCode.INVALID_ARGUMENT, StatusCode.OUT_OF_RANGE,
                                  StatusCode.FAILED_PRECONDITION, StatusCode.INTERNAL])
def test_the_requests_own_fault_goes_to_the_client_as_it_is(code):
    fakes = FakeWorkers(**{W1: [failed(code, "max_tokens must be between 1 and 4096")], W2: [[1]]})
    relay, membership = relay_for(fakes)
    with pytest.raises(Refused) as refused:
        run(relay)
    assert refused.value.code == code and refused.value.message == "max_tokens must be between 1 and 4096"
    assert fakes.workers_tried() == [W1] and alive_workers(membership) == [W1, W2]


def test_already_exists_is_retried_with_a_fresh_attempt_id():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.ALREADY_EXISTS, "request id in use"), [1, 2, 3, 4]]})
    relay, membership = relay_for(fakes, workers=[W1])
    assert run(relay, request_id="chat-7")[0] == [1, 2, 3, 4]
    first, second = (request.request_id for _, request, _ in fakes.attempts)
    assert first != second and first.startswith("chat-7.") and second.startswith("chat-7.")
    assert alive_workers(membership) == [W1]


def test_each_attempt_and_each_call_has_its_own_request_id():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.UNAVAILABLE, "connection reset"), [5]],
                           W2: [[1, 2, 3, 4], [1, 2, 3, 4]]})
    relay, _ = relay_for(fakes)
    run(relay, request_id="same")
    run(relay, request_id="same")
    ids = [request.request_id for _, request, _ in fakes.attempts]
    assert len(ids) == 3 and len(set(ids)) == 3
    assert all(i.startswith("same.") for i in ids)
    assert ids[0].rsplit(".", 1)[0] == ids[1].rsplit(".", 1)[0]  # one call's attempts share its tag


def test_a_client_without_an_id_still_gets_distinct_attempt_ids():
    fakes = FakeWorkers(**{W1: [[1], [1]]})
    relay, _ = relay_for(fakes, workers=[W1])
    run(relay)
    run(relay)
    first, second = (request.request_id for _, request, _ in fakes.attempts)
    assert first and second and first != second


def test_a_long_client_id_is_cut_in_the_attempt_ids():
    fakes = FakeWorkers(**{W1: [[1]]})
    relay, _ = relay_for(fakes, workers=[W1])
    run(relay, request_id="x" * 10_000)
    assert len(fakes.attempts[0][1].request_id) < 100


def test_the_worker_gets_what_is_left_of_the_clients_deadline():
    fakes = FakeWorkers(**{W1: [[1]]})
    relay, _ = relay_for(fakes, workers=[W1], request_timeout_s=600.0)
    run(relay, client_call(remaining=2.5))
    assert fakes.attempts[0][2] == 2.5
    run_fakes = FakeWorkers(**{W1: [[1]]})
    relay, _ = relay_for(run_fakes, workers=[W1], request_timeout_s=30.0)
    run(relay, client_call(remaining=None))
    assert run_fakes.attempts[0][2] == 30.0


def test_the_clients_own_deadline_ends_the_call_and_marks_no_worker_dead():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", tokens_first=[1])],
                           W2: [[2, 3, 4]]})
    relay, membership = relay_for(fakes)
    with pytest.raises(Refused) as refused:
        run(relay, client_call(remaining=1.0))
    assert refused.value.code == StatusCode.DEADLINE_EXCEEDED and "deadline" in refused.value.message
    assert fakes.workers_tried() == [W1] and alive_workers(membership) == [W1, W2]


def test_the_coordinators_own_timeout_tries_elsewhere_without_marking_the_worker_dead():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")], W2: [[1, 2, 3, 4]]})
    relay, membership = relay_for(fakes, request_timeout_s=5.0)
    assert run(relay, client_call(remaining=None))[0] == [1, 2, 3, 4]
    assert alive_workers(membership) == [W1, W2]


def test_a_deadline_already_passed_is_refused_before_any_worker_is_asked():
    fakes = FakeWorkers(**{W1: [[1]]})
    relay, _ = relay_for(fakes, workers=[W1])
    with pytest.raises(Refused) as refused:
        run(relay, client_call(remaining=0.0))
    assert refused.value.code == StatusCode.DEADLINE_EXCEEDED and fakes.attempts == []


def test_a_client_gone_ends_the_relay_quietly():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.CANCELLED, "Cancelled", tokens_first=[1])], W2: [[2]]})
    relay, membership = relay_for(fakes)
    tokens, last = run(relay, client_call(active=False))
    assert tokens == [1] and last.finish_reason == ""
    assert fakes.workers_tried() == [W1] and alive_workers(membership) == [W1, W2]


def test_a_sampled_request_without_seed_is_not_resumed():
    fakes = FakeWorkers(**{W1: [failed(StatusCode.UNAVAILABLE, "connection reset", tokens_first=[1])], W2: [[2]]})
    relay, _ = relay_for(fakes)
    with pytest.raises(Refused) as refused:
        run(relay, temperature=0.8)
    assert refused.value.code == StatusCode.UNAVAILABLE and "retry" in refused.value.message


def test_no_live_worker_is_unavailable():
    relay, _ = relay_for(FakeWorkers(), workers=[])
    with pytest.raises(Refused) as refused:
        run(relay)
    assert refused.value.code == StatusCode.UNAVAILABLE and "no live worker" in refused.value.message


def test_the_clients_hand_the_prompt_on_once_too():
    """coordinator.client's and aio_client's rule when they resume through another coordinator."""
    from base.generation import Finished, Piece, Prompt, Usage
    from coordinator.client import first_prompt
    prompt = Prompt([1, 2, 3], "hello")
    with_token, alone = Piece("<7>", [7], None, prompt), Piece("", [], None, prompt)
    assert first_prompt(with_token, False) is with_token and first_prompt(alone, False) is alone
    assert first_prompt(with_token, True) == Piece("<7>", [7]) and first_prompt(alone, True) is None
    finished = Finished(Usage(), "length")
    assert first_prompt(finished, True) is finished
