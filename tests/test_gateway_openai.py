"""The gateway as evaluation and load tools expect OpenAI's API (and vLLM's additions to it) to
be, on a cluster that wants client keys (a tokens file): a refusal for want of a key in HTTP's
words. A real `kvcache gateway` process, spoken to with the real `openai` client and plain HTTP."""

from __future__ import annotations

import json

import openai
import pytest

from gateway_helpers import cluster_with_gateway, http

KEY = "gateway-tests-key-0123456789"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with cluster_with_gateway(tmp_path_factory.mktemp("gateway-openai"), metrics=False, nodes=1, key=KEY) as started:
        yield started


@pytest.fixture(scope="module")
def gateway(served):
    return served[1]


@pytest.fixture(scope="module")
def api(gateway):
    with openai.OpenAI(base_url=gateway.address + "/v1", api_key=KEY, max_retries=0, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def model(api):
    [only] = api.models.list().data
    return only.id


@pytest.mark.parametrize("key, problem", [(None, "this request needs an API key"),
                                          ("not-" + KEY, "the cluster does not know this API key")])
def test_a_missing_or_unknown_key_is_told_to_send_the_http_header(gateway, model, key, problem):
    """The coordinators refuse in gRPC's words (the metadata `authorization`); an HTTP caller is
    told what to send over HTTP."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode()
    for method, path, data in (("POST", "/v1/completions", body), ("GET", "/v1/models", None)):
        status, _, answer = http(gateway.address, method, path, data, headers)
        error = json.loads(answer)["error"]
        assert status == 401 and error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert error["message"] == f"{problem}: send one the cluster knows in the header `Authorization: Bearer KEY`"
    if key:   # the openai client will not go without one
        with openai.OpenAI(base_url=gateway.address + "/v1", api_key=key, max_retries=0) as stranger:
            with pytest.raises(openai.AuthenticationError) as refused:
                stranger.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert refused.value.body["message"].startswith(problem)
