"""The gateway's tokenizers without a network: a served name found as workers name their model, ids
equal to the worker's for a chat whose template writes bos and eos, each model loaded once
however many ask at once, no more than the bound kept, and no model code loaded with the gateway."""

from __future__ import annotations

import asyncio

import pytest

from gateway import tokenizers
from gateway.errors import ApiError
from gateway.tokenizers import Tokenizers, load, served_name
from gguf_helpers import LLAMA2_CHAT, write_gguf
from test_imports import modules_loaded_by
from worker.model import load_model
from worker.model.testing import llama_config, random_tensors_for


def test_served_names_are_the_workers():
    assert served_name("tiny") == "tiny" and served_name("smollm2-135m") == "smollm2-135m"
    assert served_name("/models/chat.gguf") == "chat" and served_name("/models/Llama-3/") == "Llama-3"
    assert Tokenizers(["/models/chat.gguf"]).source("chat") == "/models/chat.gguf"
    assert Tokenizers().source("tiny") == "tiny" and Tokenizers().source("chat") is None


def test_a_chat_gets_the_workers_ids_also_where_its_template_writes_bos_and_eos(tmp_path):
    config = llama_config(vocab_size=300, eos_token_id=2, max_positions=512)
    path = tmp_path / "llama2.gguf"
    write_gguf(path, config, random_tensors_for(config, seed=3), chat_template=LLAMA2_CHAT)
    worker, ours = load_model(str(path)), load(str(path))
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"},
                {"role": "user", "content": "What is the capital?"}]
    assert ours.chat(messages) == worker.chat_token_ids(messages)
    assert ours.encode("the hat of the cat") == worker.tokenizer.encode("the hat of the cat")
    assert ours.info["bos_token"] == "<|im_start|>" and ours.info["eos_token"] == "<|im_end|>"
    assert ours.max_model_len == 512 and ours.info["chat_template"] == LLAMA2_CHAT


def test_a_preset_has_bytes_and_no_template():
    tiny = load("tiny")
    assert tiny.encode("hé") == list("hé".encode()) and tiny.decode(tiny.encode("hé")) == "hé"
    assert tiny.info["tokenizer_class"] == "ByteTokenizer" and tiny.info["eos_token"] is None
    assert tiny.prompt_tokens([1, 2, 3]) == 3 and tiny.prompt_tokens("abc") == 3
    with pytest.raises(ApiError) as refused:
        tiny.chat([{"role": "user", "content": "hi"}])
    assert refused.value.status == 400 and "no chat template" in refused.value.message


def test_loaded_once_however_many_ask_and_at_most_the_bound_kept(monkeypatch):
    loads = []

    def slow_load(source):
        loads.append(source)
        return load("tiny")

    monkeypatch.setattr(tokenizers, "load", slow_load)
    models = Tokenizers(["/m/a.gguf", "/m/b.gguf", "/m/c.gguf"], max_loaded=2)

    async def scenario():
        await asyncio.gather(*(models.get("a") for _ in range(5)))
        await models.get("b")
        await models.get("a")   # a is now the most recently used
        await models.get("c")   # b goes
        await models.get("a")
        await models.get("b")
        with pytest.raises(ApiError) as unknown:
            await models.get("nowhere")
        assert unknown.value.status == 404 and unknown.value.code == "model_not_found"

    asyncio.run(scenario())
    assert loads == ["/m/a.gguf", "/m/b.gguf", "/m/c.gguf", "/m/b.gguf"]


def test_the_gateway_loads_no_model_code_until_a_tokenizer_is_used():
    """A gateway whose callers never tokenize has no use for numpy and the model code (tokenizers note 4)."""
    loaded = modules_loaded_by("import gateway.daemon, gateway.app")
    assert "gateway.tokenizers" in loaded and "worker.model" not in loaded and "numpy" not in loaded
