"""Sliding-window attention (Mistral's `sliding_window`, GGUF's `*.attention.sliding_window`): for
prompts longer than the window, a Mistral folder and a GGUF with the same weights match an
independent float64 forward whose mask is HF's (key j visible from query i when i - W < j <= i),
through the paged pool (chunked prefill, decode) and the dense runner alike."""

import numpy as np
import pytest

from gguf_helpers import T, as_stored, train_tokenizer, write_gguf, write_hf_folder
from worker.engine.engine import Engine
from worker.model import ForwardBatch, load_model
from worker.model.dense import DenseRunner, reference_logits
from worker.model.testing import llama_config, random_tensors_for

W = 8
IDS = [int(t) for t in np.random.default_rng(9).integers(3, 300, 41)]


def textbook_mistral(t, n_head, n_kv, theta, window, ids, eps=1e-5):
    t = {k: v.astype(np.float64) for k, v in t.items()}
    n = len(ids)
    x = t["embed_tokens.weight"][ids]
    hd = t["layers.0.self_attn.q_proj.weight"].shape[0] // n_head
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    emb = np.concatenate([np.outer(np.arange(n), inv_freq)] * 2, axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = np.where((j <= i) & (j > i - window), 0.0, -np.inf)

    def rms(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    def rot(v):
        return np.concatenate([-v[..., hd // 2:], v[..., : hd // 2]], axis=-1)

    layers = 1 + max(int(k.split(".")[1]) for k in t if k.startswith("layers."))
    for layer in range(layers):
        p = f"layers.{layer}."
        h = rms(x, t[p + "input_layernorm.weight"])
        q = (h @ t[p + "self_attn.q_proj.weight"].T).reshape(n, n_head, hd).transpose(1, 0, 2)
        k = (h @ t[p + "self_attn.k_proj.weight"].T).reshape(n, n_kv, hd).transpose(1, 0, 2)
        v = (h @ t[p + "self_attn.v_proj.weight"].T).reshape(n, n_kv, hd).transpose(1, 0, 2)
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        k, v = np.repeat(k, n_head // n_kv, axis=0), np.repeat(v, n_head // n_kv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(n, -1)
        x = x + a @ t[p + "self_attn.o_proj.weight"].T
        h = rms(x, t[p + "post_attention_layernorm.weight"])
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    return rms(x, t["norm.weight"]) @ t["lm_head.weight"].T


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mistral")
    config = llama_config(vocab_size=300, eos_token_id=2)
    tensors = as_stored(random_tensors_for(config, seed=41), T.F32)
    tok = train_tokenizer(300)
    hf = load_model(str(write_hf_folder(tmp / "hf", config, tensors, tok, sliding_window=W)))
    write_gguf(tmp / "m.gguf", config, tensors, T.F32, tok=tok, sliding_window=W)
    return tensors, hf, load_model(str(tmp / "m.gguf"))


def _paged_logits(model, ids, page_tokens=4, chunk=5):
    """Prefill in chunks of `chunk` tokens over a paged pool; logits at every position."""
    c = model.config
    blocks = -(-len(ids) // page_tokens)
    pool = np.zeros((blocks + 1, c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim), np.float32)
    table = np.arange(blocks, dtype=np.int32)[::-1].copy()
    out = []
    for lo in range(0, len(ids), chunk):
        hi = min(len(ids), lo + chunk)
        batch = ForwardBatch(np.array(ids[lo:hi]), np.arange(lo, hi), np.array([0, hi - lo]), np.array([hi]),
                             [table], all_logits=True)
        out.append(model.forward(batch, pool))
    return np.concatenate(out)


def test_mistral_folder_and_gguf_match_the_textbook_window(models):
    tensors, hf, gguf_model = models
    assert hf.config.sliding_window == W and gguf_model.config.sliding_window == W
    want = textbook_mistral(tensors, 4, 2, 10000.0, W, IDS)
    unwindowed = textbook_mistral(tensors, 4, 2, 10000.0, 10 ** 6, IDS)
    assert np.abs(want[W:] - unwindowed[W:]).max() > 1e-2       # the window matters past W tokens
    for model in (hf, gguf_model):
        np.testing.assert_allclose(reference_logits(model, IDS), want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(_paged_logits(model, IDS), want, atol=1e-4, rtol=0)
        np.testing.assert_allclose(_paged_logits(model, IDS, page_tokens=16, chunk=41), want, atol=1e-4, rtol=0)


def test_decode_past_the_window_matches_recomputation(models):
    _, hf, _ = models
    engine = Engine(hf, page_tokens=4, num_blocks=64, max_prefill_tokens=6, alone_prefill_tokens=6)
    [done] = engine.generate(IDS[:20], max_new_tokens=12, ignore_eos=True)
    ids = list(IDS[:20])
    for _ in range(12):                                   # greedy by recomputing everything
        ids.append(int(np.argmax(reference_logits(hf, ids)[-1])))
    assert done.token_ids == ids[20:]
    runner = DenseRunner(hf)
    logits, state = runner.prefill(IDS[:20])
    for token in ids[20:26]:
        logits = runner.decode([state], [token])[0]
        np.testing.assert_allclose(logits, reference_logits(hf, ids[: state.length])[-1], atol=1e-4, rtol=0)
