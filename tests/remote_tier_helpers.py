"""What the tests of an engine reading pages from a kvnode share: a prompt whose shared prefix fills
8 pages, the models both run, an engine in any KV dtype, and a kvnode with a data plane."""

from __future__ import annotations

import pytest

from cluster_helpers import data_plane_nodes
from worker.engine.engine import Engine
from worker.model import load_model
from worker.model.testing import llama_config, random_model

PAGE_TOKENS = 16
SHARED = "You are a helpful assistant. Answer briefly, and cite what you read. " * 2  # 8 full pages and more
PROMPT = SHARED + "What does a kvnode store?"
PARAMS = dict(max_new_tokens=12, ignore_eos=True)

GPT2_AND_LLAMA = {
    "tiny": lambda: load_model("tiny"),   # GPT-2, 64-wide heads
    "llama-gqa": lambda: random_model(llama_config(n_layers=3, max_positions=512), seed=4),   # 16-wide heads
}


@pytest.fixture(scope="module")
def models(request):
    """The test module's MODELS (name -> how to make it), each made once for the module."""
    return {name: make() for name, make in request.module.MODELS.items()}


def engine(model, kv_dtype):
    return Engine(model, kv_dtype=kv_dtype, num_blocks=96, page_tokens=PAGE_TOKENS, max_num_batched_tokens=256,
                  seed=0)


@pytest.fixture
def node():
    """make(page_bytes): a kvnode with a data plane (pages come in bands), of that page size."""
    with data_plane_nodes(64) as make:
        yield make
