"""Logprobs through the whole cluster: what the gateway answers (chat and completions, whole and
streamed, the echoed prompt's) is the engine's own float32 log-softmax of the model's logits,
checked against the model recomputed from scratch in this process (worker/model/dense.py) on the
same GGUF file the cluster's worker serves; and lm-eval's `local-completions` model scores a
small multiple-choice task through the gateway (its loglikelihood requests: echo, logprobs,
token-id prompts, its remote tokenizer) with the engine's loglikelihoods.

Real processes on loopback (gateway_helpers.cluster_with_gateway), lm-eval run as its own
process, bounded in time, with Hugging Face's libraries kept offline and in the test's folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx2
import numpy as np
import pytest

from gateway_helpers import cluster_with_gateway
from worker.engine.logprobs import log_softmax
from worker.model import load_model
from worker.model.dense import reference_logits

TOL = 2e-5  # the worker's paged, chunked forward against the dense one: float32 sums in other orders
LM_EVAL_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateway-logprobs")
    with cluster_with_gateway(folder, metrics=False, nodes=1) as (cluster, gateway):
        yield gateway, folder / "chat.gguf"


@pytest.fixture(scope="module")
def gateway(served):
    return served[0]


@pytest.fixture(scope="module")
def model(served):
    return load_model(str(served[1]))


def post(gateway, path: str, body: dict) -> list[dict]:
    """The bodies: one for a JSON answer, one per event of a stream (without [DONE])."""
    reply = httpx2.post(gateway.address + path, json={"model": "chat", "temperature": 0, **body}, timeout=60.0)
    assert reply.status_code == 200, reply.text
    if not reply.headers["content-type"].startswith("text/event-stream"):
        return [reply.json()]
    return [json.loads(e[len("data: "):]) for e in reply.text.split("\n\n") if e and e != "data: [DONE]"]


def tokenize(gateway, prompt: str) -> list[int]:
    reply = httpx2.post(gateway.address + "/tokenize", json={"prompt": prompt}, timeout=30.0)
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def reference(model, ids) -> np.ndarray:
    """Row p: the logprobs of the token after position p."""
    return log_softmax(reference_logits(model, ids))


def joined(bodies: list[dict], name: str) -> list:
    return [x for b in bodies for c in b["choices"] if c["logprobs"] for x in c["logprobs"][name]]


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_prompts_logprobs_are_the_engines(gateway, model, stream):
    prompt = "The bakery opens at seven and the first bread comes out at"
    ids = tokenize(gateway, prompt)
    bodies = post(gateway, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 3, "max_tokens": 2,
                                               "stream": stream})
    rows = reference(model, ids)
    logprobs, tops = joined(bodies, "token_logprobs"), joined(bodies, "top_logprobs")
    assert len(logprobs) == len(ids) + 2 and logprobs[0] is None and tops[0] is None
    assert np.abs(np.array(logprobs[1:len(ids)]) - rows[np.arange(len(ids) - 1), ids[1:]]).max() <= TOL
    for p, top in enumerate(tops[1:len(ids)]):
        # the three most likely and the prompt's own token, keyed by text (two tokens of one text share a key)
        allowed = [*np.sort(rows[p])[::-1][:3], rows[p, ids[p + 1]]]
        assert abs(max(top.values()) - allowed[0]) <= TOL and 1 <= len(top) <= 4
        assert all(min(abs(v - a) for a in allowed) <= TOL for v in top.values())
    text = "".join(c["text"] for b in bodies for c in b["choices"])
    assert text.startswith(prompt) and "".join(joined(bodies, "tokens")) == text
    offsets = joined(bodies, "text_offset")
    assert offsets == list(np.cumsum([0] + [len(t) for t in joined(bodies, "tokens")[:-1]]))


def test_the_prompt_alone_and_its_generated_tokens_agree(gateway, model):
    """max_tokens 0 with echo (the prompt alone, `length`, no completion tokens), and a generated
    token's logprob equal to the one the prompt gives it once it is part of a longer prompt."""
    ids = tokenize(gateway, "Rye and spelt")
    [alone] = post(gateway, "/v1/completions", {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 0})
    [choice] = alone["choices"]
    assert choice["finish_reason"] == "length" and alone["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["text"] == "".join(choice["logprobs"]["tokens"])
    bodies = post(gateway, "/v1/completions", {"prompt": ids, "logprobs": 1, "max_tokens": 3, "ignore_eos": True,
                                               "return_token_ids": True, "stream": True})
    new = [t for b in bodies for c in b["choices"] for t in c.get("token_ids") or []]
    rows = reference(model, ids + new)
    got = joined(bodies, "token_logprobs")
    assert len(got) == len(new) == 3
    assert np.abs(np.array(got) - rows[np.arange(len(ids) - 1, len(ids) + 2), new]).max() <= TOL
    [longer] = post(gateway, "/v1/completions", {"prompt": ids + new, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert np.abs(np.array(longer["choices"][0]["logprobs"]["token_logprobs"][len(ids):]) - got).max() <= TOL


@pytest.mark.parametrize("stream", [False, True])
def test_a_chats_logprobs_are_the_engines(gateway, model, stream):
    messages = [{"role": "user", "content": "Which bread keeps longest?"}]
    chat_ids = httpx2.post(gateway.address + "/tokenize", json={"messages": messages}, timeout=30.0).json()["tokens"]
    bodies = post(gateway, "/v1/chat/completions", {"messages": messages, "logprobs": True, "top_logprobs": 2,
                                                    "max_tokens": 5, "ignore_eos": True, "stream": stream,
                                                    "return_token_ids": stream})
    items = joined(bodies, "content")
    assert len(items) == 5
    new = ([t for b in bodies for c in b["choices"] for t in c.get("token_ids") or []] if stream else None)
    for item in items:   # greedy: each chosen token is the most likely one
        assert item["top_logprobs"][0]["logprob"] == item["logprob"] and len(item["top_logprobs"]) == 2
        assert item["token"] == bytes(item["bytes"]).decode(errors="replace")
    if stream:
        rows = reference(model, chat_ids + new)
        want = rows[np.arange(len(chat_ids) - 1, len(chat_ids) + 4), new]
        assert np.abs(np.array([i["logprob"] for i in items]) - want).max() <= TOL


TASK = """task: kvcache_bread
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [
    {"question": "Which grain makes the darkest bread?", "choices": ["rye", "rice", "corn"], "answer": 0},
    {"question": "What makes a dough rise?", "choices": ["salt", "yeast", "butter"], "answer": 1},
    {"question": "How long does a sourdough starter take to grow?", "choices": ["an hour", "a week"], "answer": 1},
    {"question": "Where is bread baked?", "choices": ["in an oven", "in a fridge", "in a well", "in a pan"],
     "answer": 0},
]


def lm_eval_loglikelihood(model, context: str, continuation: str) -> float:
    """The engine's loglikelihood of a continuation, its tokens cut as lm-eval cuts them (the context's
    trailing spaces go to the continuation; the pair is encoded whole, the context's tokens taken off)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    encode = model.tokenizer.encode
    whole, context_ids = encode(context + continuation, add_special_tokens=False), encode(context, add_special_tokens=False)
    rows = reference(model, whole)
    return float(sum(rows[p - 1, whole[p]] for p in range(len(context_ids), len(whole))))


def test_lm_eval_scores_a_multiple_choice_task_through_the_gateway(gateway, model, tmp_path):
    """lm-eval's local-completions model with its remote tokenizer (/tokenizer_info, /tokenize): each
    choice's loglikelihood is a prompt of a completions request with echo and logprobs (four prompts
    a request); they are the engine's, and its accuracy is what they make of the task."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        pytest.fail("lm-eval is a test dependency (pyproject's dev extra): `make install` installs it")
    (tmp_path / "bread.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kvcache_bread.yaml").write_text(TASK.format(data=tmp_path / "bread.jsonl"))
    hf = tmp_path / "hf"
    env = {**os.environ, "HF_HOME": str(hf), "HF_DATASETS_CACHE": str(hf / "datasets"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OPENAI_API_KEY": ""}
    model_args = (f"model=chat,base_url={gateway.address}/v1/completions,tokenizer_backend=remote,"
                  f"num_concurrent=1,max_retries=1,timeout=60")
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", "kvcache_bread", "--include_path", str(tasks), "--output_path", str(tmp_path / "out"),
               "--log_samples", "--batch_size", "4"]   # several prompts a request (OpenAI's list of prompts)
    try:
        run = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=LM_EVAL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:   # subprocess.run killed it, by its own pid
        pytest.fail(f"lm-eval ran past {LM_EVAL_TIMEOUT_S:.0f}s: {(exc.stderr or b'')[-3000:]!r}")
    assert run.returncode == 0, run.stderr[-5000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    [samples_file] = (tmp_path / "out").rglob("samples_kvcache_bread_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    correct = []
    for sample, doc in zip(samples, DOCS):
        context = f"Question: {doc['question']}\nAnswer:"
        ours = [lm_eval_loglikelihood(model, context, " " + choice) for choice in doc["choices"]]
        theirs = [float(ll) for ll, _ in sample["filtered_resps"]]
        assert np.abs(np.array(theirs) - ours).max() <= 1e-4, (doc, theirs, ours)
        correct.append(int(np.argmax(ours)) == doc["answer"])
        assert sample["acc"] == float(correct[-1])
    results = json.loads(results_file.read_text())["results"]["kvcache_bread"]
    assert results["acc,none"] == pytest.approx(sum(correct) / len(DOCS))
