"""The engine's logprobs against Hugging Face transformers' own forward of the default model
(SmolLM2-135M, exported as a Hugging Face folder): each prompt token's logprob (what an echo with
logprobs answers) and each generated token's, in float32 on both sides. Here because transformers
and torch are in this environment (vLLM's), not in the main one."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine.engine import Engine

TOL = 2e-4  # two float32 implementations of 30 layers (3.7e-5 apart here): sums in other orders, another softmax


def test_prompt_and_generated_logprobs_equal_transformers(model_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    engine = Engine.load(str(model_dir), max_prefill_tokens=16, alone_prefill_tokens=16)   # its prompt in chunks
    text = "The bakery opens at seven, and the first loaves of rye bread come out of the oven at"
    ids = engine.tokenizer.encode(text)
    [done] = engine.generate(ids, max_new_tokens=4, prompt_logprobs=0, logprobs=0, echo=True)
    ours = [e.chosen.logprob for e in done.prompt.logprobs] + [e.chosen.logprob for e in done.logprobs]
    whole = ids + done.token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0]
    theirs = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(whole) - 1), torch.tensor(whole[1:])].numpy()
    assert len(ours) == len(whole) - 1
    assert np.abs(np.array(ours) - theirs).max() <= TOL
    assert done.token_ids == [int(t) for t in logits[len(ids) - 1:-1].argmax(dim=-1)]   # greedy: theirs too
