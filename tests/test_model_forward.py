"""The paged forward equals a full recompute without any cache (logits within 1e-4, same greedy
tokens), for GPT-2, Llama (GQA, tied and untied heads) and Qwen2 (q/k/v biases), prefill whole or
in chunks, several sequences batched together, float32 and float16 KV."""

import numpy as np
import pytest

from worker.model import ForwardBatch, load_model
from worker.model.dense import DenseRunner, reference_logits
from worker.model.testing import gpt2_config, llama_config, qwen2_config, random_model

ATOL = 1e-4
# float16 KV rounding is a step function: the last-bit float32 differences between a batched and a
# one-row matmul can land a key on the other side of a float16 rounding boundary (a relative step
# of ~5e-4), which moves logits by up to ~1e-3. Greedy tokens must still agree exactly.
ATOL_FP16_KV = 3e-3

CONFIGS = {
    "gpt2": gpt2_config(),
    "llama-gqa-untied": llama_config(),
    "llama-gqa1-tied": llama_config(n_kv_heads=1, tie_word_embeddings=True),
    "llama-mha-headdim": llama_config(n_kv_heads=4, head_dim=24, rope_theta=500000.0),
    "qwen2-qkv-bias-tied": qwen2_config(tie_word_embeddings=True),
}


class PagedRunner:
    """Drives Model.forward as an engine would: one pool, shuffled block ids, a table per sequence."""

    def __init__(self, model, page_tokens=4, num_blocks=128, kv_dtype="float32", seed=0, pool_dtype=np.float32):
        c = model.config
        self.model, self.P, self.kv_dtype = model, page_tokens, kv_dtype
        self.pool = np.zeros((num_blocks, c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim), pool_dtype)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tables, self.lens = {}, {}

    def step(self, chunks, all_logits=False, between_layers=None):
        """Feed each sequence id its next tokens, all in one forward."""
        ids, pos, starts, ctx, tables = [], [], [0], [], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            end = start + len(toks)
            while len(table) * self.P < end:
                table.append(self.free.pop())
            ids += [int(t) for t in toks]
            pos += range(start, end)
            starts.append(len(ids))
            ctx.append(end)
            tables.append(np.array(table, dtype=np.int32))
            self.lens[sid] = end
        batch = ForwardBatch(np.array(ids, np.int64), np.array(pos, np.int64), np.array(starts, np.int64),
                             np.array(ctx, np.int64), tables, all_logits=all_logits)
        return self.model.forward(batch, self.pool, self.kv_dtype, between_layers=between_layers)


def _prompt(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 256, n)]


def _greedy_reference(model, prompt, steps, kv_dtype):
    """Greedy tokens and per-step logits by full recompute of the whole sequence each step."""
    seq, logits = list(prompt), []
    for _ in range(steps):
        last = reference_logits(model, seq, kv_dtype)[-1]
        logits.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt):], np.array(logits)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_matches_full_recompute(name, kv_dtype):
    model = random_model(CONFIGS[name], seed=1)
    atol = ATOL if kv_dtype == "float32" else ATOL_FP16_KV
    prompt = _prompt(2, 13)
    want_tokens, want_logits = _greedy_reference(model, prompt, 8, kv_dtype)
    runner = PagedRunner(model, kv_dtype=kv_dtype)
    prefill = runner.step({0: prompt}, all_logits=True)
    np.testing.assert_allclose(prefill, reference_logits(model, prompt, kv_dtype), atol=atol, rtol=0)
    got_tokens, got_logits = [int(prefill[-1].argmax())], [prefill[-1]]
    for _ in range(7):
        step = runner.step({0: [got_tokens[-1]]})
        assert step.shape == (1, model.config.vocab_size)
        got_logits.append(step[0])
        got_tokens.append(int(step[0].argmax()))
    assert got_tokens == want_tokens
    np.testing.assert_allclose(np.array(got_logits), want_logits, atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_and_mixed_batches_match_full_recompute(name):
    model = random_model(CONFIGS[name], seed=3)
    prompts = {0: _prompt(10, 23), 1: _prompt(11, 9), 2: _prompt(12, 17)}
    runner = PagedRunner(model, page_tokens=4)
    got = {sid: [] for sid in prompts}
    # Step 1: seq 0 prefills 7 tokens, seq 1 its whole prompt. Step 2: seq 0 six more, seq 2 five.
    # Step 3: seq 0 the rest, seq 1 decodes, seq 2 the rest. The chunk boundaries cut pages.
    plan = [{0: (0, 7), 1: (0, 9)}, {0: (7, 13), 2: (0, 5)}, {0: (13, 23), 2: (5, 17)}]
    for step in plan:
        chunks = {sid: prompts[sid][a:b] for sid, (a, b) in step.items()}
        logits = runner.step(chunks, all_logits=True)
        row = 0
        for sid, toks in chunks.items():
            got[sid].append(logits[row:row + len(toks)])
            row += len(toks)
        assert row == len(logits)
    for sid, prompt in prompts.items():
        np.testing.assert_allclose(np.concatenate(got[sid]), reference_logits(model, prompt), atol=ATOL, rtol=0)
    # Then all three decode together, greedy, and must follow their own full recomputes.
    seqs = {sid: list(p) for sid, p in prompts.items()}
    last = {sid: int(np.concatenate(got[sid])[-1].argmax()) for sid in prompts}
    for _ in range(5):
        for sid in seqs:
            seqs[sid].append(last[sid])
        logits = runner.step({sid: [last[sid]] for sid in seqs})
        for row, sid in enumerate(seqs):
            want = reference_logits(model, seqs[sid])[-1]
            np.testing.assert_allclose(logits[row], want, atol=ATOL, rtol=0)
            assert int(logits[row].argmax()) == int(want.argmax())
            last[sid] = int(logits[row].argmax())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_another_forward_between_the_layers_of_a_chunk_leaves_both_exact(name):
    """What the engine does for a short newcomer: a whole forward of another sequence, over the
    same pool, run after one layer of a chunk of a cached sequence; then the chunk goes on."""
    model = random_model(CONFIGS[name], seed=6)
    long, short = _prompt(30, 29), _prompt(31, 7)
    runner = PagedRunner(model, page_tokens=4)
    runner.step({0: long[:9]})
    calls, nested = [], []

    def between_layers():
        calls.append(len(calls))
        if len(calls) == 1:
            nested.append(runner.step({1: short}, all_logits=True))

    chunk = runner.step({0: long[9:]}, all_logits=True, between_layers=between_layers)
    assert len(calls) == model.config.n_layers - 1
    np.testing.assert_allclose(chunk, reference_logits(model, long)[9:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(nested[0], reference_logits(model, short), atol=ATOL, rtol=0)


def test_decode_and_prefill_in_one_batch_last_token_logits():
    model = random_model(CONFIGS["llama-gqa-untied"], seed=4)
    a, b = _prompt(20, 30), _prompt(21, 11)
    runner = PagedRunner(model, page_tokens=8)
    runner.step({0: a[:29]})
    out = runner.step({0: a[29:], 1: b})   # seq 0 decodes its 30th token while seq 1 prefills
    assert out.shape == (2, model.config.vocab_size)
    np.testing.assert_allclose(out[0], reference_logits(model, a)[-1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(out[1], reference_logits(model, b)[-1], atol=ATOL, rtol=0)


def test_float16_kv_is_rounded_in_the_pool():
    model = random_model(CONFIGS["gpt2"], seed=5)
    runner = PagedRunner(model, kv_dtype="float16")
    runner.step({0: _prompt(30, 10)})
    used = runner.pool[runner.tables[0]]
    assert used.any()
    np.testing.assert_array_equal(used, used.astype(np.float16).astype(np.float32))
    runner32 = PagedRunner(model, kv_dtype="float32")
    runner32.step({0: _prompt(30, 10)})
    assert not np.array_equal(runner32.pool[runner32.tables[0]], used)  # float32 KV keeps full precision


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_float16_pool_gives_the_float32_pools_logits_bit_for_bit(name):
    """float16 KV kept in a float16 pool reads back the very values a float32 pool holds, so every
    logit is equal: chunked prefill, a prefill beside a decode, batched decodes."""
    model = random_model(CONFIGS[name], seed=7)
    runners = [PagedRunner(model, kv_dtype="float16", pool_dtype=d) for d in (np.float32, np.float16)]
    a, b = _prompt(40, 37), _prompt(41, 21)
    steps = [{0: a[:16]}, {0: a[16:], 1: b[:6]}, {1: b[6:]}]
    for step in steps:
        single, half = (r.step(step, all_logits=True) for r in runners)
        np.testing.assert_array_equal(half.view(np.uint32), single.view(np.uint32))
    tokens = [7, int(single[-1].argmax())]
    for _ in range(6):
        single, half = (r.step({0: [tokens[0]], 1: [tokens[1]]}) for r in runners)
        np.testing.assert_array_equal(half.view(np.uint32), single.view(np.uint32))
        tokens = [int(t) for t in single.argmax(axis=-1)]
    assert runners[1].pool.dtype == np.float16
    np.testing.assert_array_equal(runners[1].pool.astype(np.float32).view(np.uint32), runners[0].pool.view(np.uint32))


def test_dense_runner_matches_reference():
    model = random_model(CONFIGS["llama-gqa-untied"], seed=6)
    runner = DenseRunner(model)
    prompts = [_prompt(40, 12), _prompt(41, 3)]
    states, seqs, last = [], [], []
    for p in prompts:
        logits, state = runner.prefill(p)
        np.testing.assert_allclose(logits, reference_logits(model, p)[-1], atol=ATOL, rtol=0)
        states.append(state)
        seqs.append(list(p))
        last.append(int(logits.argmax()))
    for _ in range(6):   # capacity of the short one (2 * 3) overflows: the state grows
        for s, t in zip(seqs, last):
            s.append(t)
        logits = runner.decode(states, last)
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(logits[i], reference_logits(model, s)[-1], atol=ATOL, rtol=0)
        last = [int(x) for x in logits.argmax(axis=1)]


def test_batch_validation_refuses_bad_input():
    model = random_model(gpt2_config(max_positions=16), seed=7)
    runner = PagedRunner(model)
    with pytest.raises(ValueError, match="beyond the model's 16 positions"):
        runner.step({0: _prompt(50, 17)})
    pool = runner.pool
    ok = dict(token_ids=np.array([1, 2]), positions=np.array([0, 1]), query_starts=np.array([0, 2]),
              context_lens=np.array([2]), block_tables=[np.array([0])])
    model.forward(ForwardBatch(**ok), pool)
    bad_cases = [
        (dict(positions=np.array([1, 2])), "contiguous and ending at context_len - 1"),
        (dict(token_ids=np.array([1, 300])), "token ids should be in"),
        (dict(query_starts=np.array([0, 1])), "query_starts"),
        (dict(block_tables=[np.array([], dtype=np.int32)]), "block table needs 1"),
        (dict(block_tables=[np.array([999])]), "block table needs 1"),
    ]
    for change, message in bad_cases:
        with pytest.raises(ValueError, match=message):
            model.forward(ForwardBatch(**{**ok, **change}), pool)
    with pytest.raises(ValueError, match="kv_dtype"):
        model.forward(ForwardBatch(**ok), pool, "bfloat16")
    with pytest.raises(ValueError, match="kv_pool should be C-ordered float32"):
        model.forward(ForwardBatch(**ok), pool[:, :1])


def test_tiny_preset_is_deterministic_and_not_degenerate():
    a, b = load_model("tiny"), load_model("tiny")
    c = a.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.head_dim, c.vocab_size, c.max_positions, c.eos_token_id) == \
        ("gpt2", 4, 256, 4, 64, 257, 1024, 256)
    assert a.weights_digest == b.weights_digest
    runner = DenseRunner(a)
    outputs = []
    for text in ["Hello, world! ", "The capital of France is"]:
        logits, state = runner.prefill(a.tokenizer.encode(text))
        out = []
        for _ in range(30):
            out.append(int(logits.argmax()))
            logits = runner.decode([state], [out[-1]])[0]
        outputs.append(out)
        assert len(set(out)) >= 10, out      # not one repeated token
    assert outputs[0] != outputs[1]          # continuations depend on the prompt


def test_blas_threads_one_for_small_forwards_and_attention(monkeypatch):
    from threadpoolctl import ThreadpoolController

    import worker.model as model_module
    from worker.model import gpt2

    controller = ThreadpoolController()   # scans the loaded libraries once; info() re-reads thread counts

    def blas_threads():
        return [i["num_threads"] for i in controller.info() if i["user_api"] == "blas"]

    seen = {"attention": [], "mlp": []}
    real_attention, real_mlp = model_module.paged_attention, gpt2.mlp

    def attention(*args):
        seen["attention"].append(blas_threads())
        return real_attention(*args)

    def mlp(*args):
        seen["mlp"].append(blas_threads())
        return real_mlp(*args)

    monkeypatch.setattr(model_module, "paged_attention", attention)
    monkeypatch.setattr(gpt2, "mlp", mlp)
    runner = PagedRunner(random_model(gpt2_config(), seed=8, invariant=False))
    assert blas_threads(), "threadpoolctl finds numpy's BLAS"
    with controller.limit(limits=2, user_api="blas"):   # a default of 2 threads even on a 1-core machine
        two = blas_threads()
        runner.step({0: _prompt(60, 100)})      # 100 rows: weight matmuls keep the default
        assert seen["mlp"] and all(t == two for t in seen["mlp"])
        seen["mlp"].clear()
        runner.step({0: [5]})                   # a decode step: everything on one thread
        one = [1] * len(two)
        assert seen["mlp"] and all(t == one for t in seen["mlp"])
        assert seen["attention"] and all(t == one for t in seen["attention"])
        assert blas_threads() == two            # restored afterwards
    # Invariant numerics: BLAS on one thread throughout (a large product splits its panels itself).
    seen["mlp"].clear()
    runner = PagedRunner(random_model(gpt2_config(), seed=8, invariant=True))
    with controller.limit(limits=2, user_api="blas"):
        runner.step({0: _prompt(60, 100)})
        assert seen["mlp"] and all(t == [1] * len(two) for t in seen["mlp"])
        assert blas_threads() == two
