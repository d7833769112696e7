"""GGUF files written here with gguf.GGUFWriter (as llama.cpp's converter writes them: Q/K rows
permuted, weights quantized) load into the same float32 weights and logits as the same weights in
a safetensors folder; the tokenizer built from their metadata encodes as the tokenizer it was
taken from; broken files are refused by name."""

import gguf
import numpy as np
import pytest

from gguf_helpers import T, as_stored, train_tokenizer, write_gguf, write_hf_folder
from worker.model import CheckpointError, ForwardBatch, load_model
from worker.model.dense import reference_logits
from worker.model.gguf_file import GGUFFile, _decoded, permute_rows, unpermute_rows
from worker.model.testing import llama_config, random_tensors_for

IDS = [int(t) for t in np.random.default_rng(8).integers(3, 300, 37)]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(300)


def _config(**overrides):
    return llama_config(vocab_size=300, eos_token_id=2, **overrides)


def _paged_logits(model, ids, page_tokens=8):
    c = model.config
    blocks = -(-len(ids) // page_tokens)
    pool = np.zeros((blocks + 1, c.n_layers, 2, c.n_kv_heads, page_tokens, c.head_dim), np.float32)
    batch = ForwardBatch(np.array(ids), np.arange(len(ids)), np.array([0, len(ids)]), np.array([len(ids)]),
                         [np.arange(blocks, dtype=np.int32)], all_logits=True)
    return model.forward(batch, pool)


def _assert_same_model(gguf_model, hf_model):
    a, b = gguf_model.config, hf_model.config
    assert (a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, a.d_ff, a.tie_word_embeddings, a.rope_theta) == \
           (b.n_layers, b.n_heads, b.n_kv_heads, b.head_dim, b.d_ff, b.tie_word_embeddings, b.rope_theta)
    assert gguf_model.weights_digest == hf_model.weights_digest     # the same float32 weights, bit for bit
    want = reference_logits(hf_model, IDS)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(reference_logits(gguf_model, IDS), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(_paged_logits(gguf_model, IDS), want, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1])
@pytest.mark.parametrize("tied", [False, True])
def test_gguf_gives_the_logits_of_the_same_weights_from_safetensors(tmp_path, tok, qtype, tied):
    config = _config(tie_word_embeddings=tied)
    tensors = random_tensors_for(config, seed=21)
    write_gguf(tmp_path / "m.gguf", config, tensors, qtype, tok=tok)
    hf = load_model(str(write_hf_folder(tmp_path / "hf", config, as_stored(tensors, qtype), tok)))
    _assert_same_model(load_model(str(tmp_path / "m.gguf")), hf)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quants_dequantize_with_ggufs_own_code(tmp_path, tok, qtype):
    """gguf-py cannot quantize to K-quants: the blocks are random bytes (each byte < 0x30, so every
    float16 scale in them is finite and small), and the HF side gets gguf's dequantization of them."""
    config = _config(d_model=256, head_dim=64, d_ff=256)          # K-quant blocks are 256 wide
    tensors = random_tensors_for(config, seed=22)
    rng = np.random.default_rng(23)
    # gguf name -> (HF name, [rows, cols], heads whose rows llama.cpp permuted)
    targets = {"blk.0.attn_q.weight": ("layers.0.self_attn.q_proj.weight", (256, 256), 4),
               "blk.1.attn_k.weight": ("layers.1.self_attn.k_proj.weight", (128, 256), 2),
               "blk.0.ffn_down.weight": ("layers.0.mlp.down_proj.weight", (256, 256), None),
               "output.weight": ("lm_head.weight", (300, 256), None)}
    raw, hf_tensors = {}, dict(tensors)
    for name, (hf_name, shape, heads) in targets.items():
        data = rng.integers(0, 0x30, gguf.quant_shape_to_byte_shape(shape, qtype), dtype=np.uint8)
        raw[name] = (data, qtype)
        values = gguf.dequantize(data, qtype).reshape(shape).astype(np.float32)
        hf_tensors[hf_name] = unpermute_rows(values, heads) if heads else values
    write_gguf(tmp_path / "k.gguf", config, tensors, T.F32, tok=tok, raw=raw)
    hf = load_model(str(write_hf_folder(tmp_path / "hf", config, hf_tensors, tok)))
    model = load_model(str(tmp_path / "k.gguf"))
    assert model.weights_digest == hf.weights_digest
    want = reference_logits(hf, IDS[:9])
    assert np.isfinite(want).all()
    np.testing.assert_allclose(reference_logits(model, IDS[:9]), want, rtol=1e-6)


def _types(value) -> list[type]:
    return [type(v) for v in (value if isinstance(value, list) else [value])]


def test_the_file_reads_as_ggufs_own_reader_reads_it(tmp_path, tok):
    """GGUFFile (worker/model/gguf_file.py) against gguf.GGUFReader: every metadata value (strings,
    string and number arrays, floats, bools) and every tensor's type, shape and data."""
    config = _config()
    for qtype in (T.F16, T.BF16, T.Q4_1):  # typed as float16, bytes (no NumPy type), bytes (quantized)
        path = tmp_path / f"{qtype.name}.gguf"
        write_gguf(path, config, random_tensors_for(config, seed=30), qtype, tok=tok, sliding_window=16)
        ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
        keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
        assert list(ours.fields) == keys and {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= set(keys)
        for key in keys:
            want, got = theirs.fields[key].contents(), _decoded(ours.fields[key])
            assert got == want and _types(got) == _types(want), key
        assert [(t.name, t.tensor_type, t.shape) for t in ours.tensors] == \
               [(t.name, t.tensor_type, tuple(t.shape.tolist())) for t in theirs.tensors]
        for mine, reference in zip(ours.tensors, theirs.tensors):
            assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape, mine.name
            np.testing.assert_array_equal(mine.data, reference.data)


def test_qk_permutation_is_undone():
    w = np.arange(4 * 16 * 3, dtype=np.float32).reshape(4 * 16, 3)
    permuted = permute_rows(w, 4)
    assert not np.array_equal(permuted, w)
    # llama.cpp's layout: within a head, row 2i is HF row i and row 2i+1 is HF row i + head_dim/2.
    np.testing.assert_array_equal(permuted[0], w[0])
    np.testing.assert_array_equal(permuted[1], w[8])
    np.testing.assert_array_equal(permuted[2], w[1])
    np.testing.assert_array_equal(unpermute_rows(permuted, 4), w)


def test_tokenizer_from_metadata_encodes_as_the_original(tmp_path, tok):
    config = _config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=24), tok=tok)
    model = load_model(str(tmp_path / "m.gguf"))
    for text in ["the cat sat on the mat", "What is the capital of France? 1234 é", "  two  spaces\nand\n\nlines",
                 "<|im_start|>user\nthe hat<|im_end|>\n<|im_start|>assistant\n"]:
        assert model.tokenizer.encode(text) == tok.encode(text).ids, text
    ids = model.tokenizer.encode("<|im_start|>user\nthe cat<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2                    # special tokens are single tokens
    assert model.tokenizer.decode(ids) == "user\nthe cat"  # and skipped when decoding
    assert model.tokenizer.eos_token_id == 2 and model.config.eos_token_id == 2


# ------------------------------------------------------------------ refusals

def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk.gguf: not a readable GGUF file"):
        load_model(str(path))


@pytest.mark.parametrize("keep", [0.05, 0.5, 0.99])
def test_a_truncated_gguf_is_refused(tmp_path, tok, keep):
    config = _config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=25), T.Q8_0, tok=tok)
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut.gguf: not a readable GGUF file, or truncated"):
        load_model(str(tmp_path / "cut.gguf"))


def test_an_unknown_architecture_is_refused(tmp_path, tok):
    config = _config()
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=26), arch="gptneox", tok=tok)
    with pytest.raises(CheckpointError, match=r"unsupported architecture 'gptneox' \(supported: llama, qwen2\)"):
        load_model(str(tmp_path / "m.gguf"))


def test_an_unsupported_tensor_type_names_the_tensor_and_type(tmp_path, tok):
    config = _config()
    data = np.zeros(gguf.quant_shape_to_byte_shape((160, 64), T.IQ4_NL), np.uint8)
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=27), tok=tok,
               raw={"blk.1.ffn_up.weight": (data, T.IQ4_NL)})
    with pytest.raises(CheckpointError, match=r"tensor 'blk.1.ffn_up.weight' has type IQ4_NL, which we cannot"):
        load_model(str(tmp_path / "m.gguf"))


def test_a_missing_tensor_and_an_unknown_kind_of_vocabulary_are_named(tmp_path, tok):
    config = _config()
    tensors = random_tensors_for(config, seed=28)
    del tensors["layers.1.mlp.up_proj.weight"]
    write_gguf(tmp_path / "m.gguf", config, tensors, tok=tok)
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk.1.ffn_up.weight'"):
        load_model(str(tmp_path / "m.gguf"))
    write_gguf(tmp_path / "t5.gguf", config, random_tensors_for(config, seed=28), tok=tok, tokenizer_model="t5")
    with pytest.raises(CheckpointError, match=r"tokenizer.ggml.model='t5' is not supported \(supported: 'gpt2' "
                                              r"\(byte-level BPE\), 'llama' \(SentencePiece BPE\)\)"):
        load_model(str(tmp_path / "t5.gguf"))
