"""One pass of the load bench against a scripted client: a session's turns carry the model's
replies as token ids (workload.Request.follows_reply), other requests go as text, and a failed turn ends its session."""

from base.generation import Finished, Piece, Usage
from coordinator.client import ClusterError
from kvcache.bench import loadrun
from kvcache.bench.loadrun import PassRun, run_pass
from kvcache.bench.workload import WorkloadConfig, build_workload
from worker.model.tokenizer import ByteTokenizer

import grpc


class ScriptedClient:
    """Stands in for coordinator.client.Client: records each call; replies with bytes 200, 201, ..."""

    calls = []
    fail_call = None

    def __init__(self, coordinators, timeout):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def generate(self, prompt, session_id="", max_tokens=1, no_cache=False, ignore_eos=False):
        ScriptedClient.calls.append((prompt, session_id, no_cache))
        if len(ScriptedClient.calls) == ScriptedClient.fail_call:
            raise ClusterError(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        reply = [200 + i for i in range(max_tokens)]
        for token in reply:
            yield Piece("", [token])
        size = len(prompt)
        yield Finished(Usage(prompt_tokens=size, computed_tokens=size, completion_tokens=max_tokens, ttft_ms=1.0),
                       "length")


def run(monkeypatch, jobs, fail_call=None):
    monkeypatch.setattr(loadrun, "Client", ScriptedClient)
    ScriptedClient.calls, ScriptedClient.fail_call = [], fail_call
    run_ = PassRun([], [], [], concurrency=1, no_cache=False, max_tokens=3, duration_s=60.0,
                   tokenizer=ByteTokenizer(), progress=False)
    results, _, _, _ = run_pass(run_, jobs, "test")
    return results, ScriptedClient.calls


def test_session_turns_send_the_last_prompt_and_the_reply_as_token_ids(monkeypatch):
    jobs = build_workload(WorkloadConfig(requests=7, seed=2, mix=(1, 1, 1), session_turns=3), "t ")
    results, calls = run(monkeypatch, jobs)
    assert len(results) == len(calls) == 7 and all(r.ok for r in results)
    sent = iter(calls)
    for job in jobs:
        history = None
        for request in job.requests:
            prompt, session_id, _ = next(sent)
            assert session_id == request.session_id
            if request.kind != "session":
                assert prompt == request.prompt
            elif not request.follows_reply:
                assert prompt == list(request.prompt.encode())
            else:
                assert prompt == history + [200, 201, 202] + list(request.prompt.encode())
            history = prompt
    assert any(r.follows_reply for job in jobs for r in job.requests)


def test_a_failed_turn_ends_its_session(monkeypatch):
    jobs = build_workload(WorkloadConfig(requests=3, mix=(0, 1, 0), session_turns=3), "t ")
    results, calls = run(monkeypatch, jobs, fail_call=2)
    assert [r.ok for r in results] == [True, False] and len(calls) == 2
    assert "scripted failure" in results[1].error
