"""A GGUF's SentencePiece vocabulary (tokenizer.ggml.model = "llama"): the tokenizer built from its
pieces and scores encodes as SentencePiece itself does with the model they came from (a small BPE
trained here with byte fallback, as Llama's was), decodes back to the text, and a tiny Llama with
such a vocabulary generates, from a prompt and from a chat, through the engine."""

import random

import pytest

from gguf_helpers import LLAMA2_CHAT, sentencepiece_metadata, train_sentencepiece, write_gguf
from worker.engine.engine import Engine
from worker.model import CheckpointError, load_model, load_model_tokenizer
from worker.model.testing import llama_config, random_tensors_for
from worker.engine.sampling import SamplingParams, StopChecker

SEP = "<sep>"
TEXTS = ["", " ", "   ", "Hello world", " leading space", "trailing space ", "multiple   spaces    here",
         "line\nbreak\n\nand\ttab\n", "\n", "12345 678.9 and 1984", "What?! (yes) -- no; 'quoted' \"double\" {x}",
         "日本語のテキスト 🙂 über", "naïve café déjà vu", "The quick brown fox jumps over the lazy dog. " * 3,
         "tokenizerstokenizers", "x=1;y=2", "  indented   with    spaces  "]


@pytest.fixture(scope="module")
def sp():
    return train_sentencepiece(400, user_defined=[SEP])


def _write(path, sp, spm_keys=None, **options):
    """A random tiny Llama that never picks <unk> or a byte piece (their head rows are zero, so their
    logits lose to the best of the others): its text is then valid UTF-8 token by token."""
    config = llama_config(vocab_size=sp.get_piece_size(), eos_token_id=2)
    tensors = random_tensors_for(config, seed=41)
    tensors["lm_head.weight"][[i for i in range(config.vocab_size) if sp.is_unknown(i) or sp.is_byte(i)]] = 0
    write_gguf(path, config, tensors, spm=sentencepiece_metadata(sp, [SEP]), spm_keys=spm_keys, **options)
    return path


@pytest.fixture(scope="module")
def tok(sp, tmp_path_factory):
    return load_model_tokenizer(str(_write(tmp_path_factory.mktemp("spm") / "spm.gguf", sp)))


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_as_sentencepiece_and_decodes_back(tok, sp, text):
    assert tok.encode(text) == [1] + sp.encode(text)                        # BOS, as the file says
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text == sp.decode(sp.encode(text))


def test_random_texts_encode_as_sentencepiece(tok, sp):
    """Pieces, spaces, digits and characters outside the vocabulary (bytes), in random orders."""
    rng = random.Random(7)
    alphabet = list("the cat sat on a mat, capital France: quick brown fox \n\t0123456789.!?-'é日🙂") + [
        "the ", " of", "ing", "   ", "Hello", "world"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert tok.encode(text) == [1] + sp.encode(text), repr(text)
        assert tok.decode(tok.encode(text)) == text, repr(text)


def test_pieces_outside_the_vocabulary_become_bytes(tok, sp):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert [sp.id_to_piece(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    assert tok.decode(ids) == "🙂"
    assert tok.decode(ids[:3]).endswith("\ufffd")      # half a character, as the streaming decoder expects


def test_control_tokens_in_text_are_single_tokens_and_not_decoded(tok, sp):
    ids = tok.encode("<s> and </s> more")
    assert ids == [1, 1] + sp.encode(" and ") + [2] + sp.encode(" more")
    assert tok.decode(ids) == " and   more"          # each run's prefix space stays but the first


def test_user_defined_tokens_and_the_space_prefix_after_them(tok, sp):
    """A user-defined token is one token; the text after it gets its own space prefix, as llama.cpp
    (and Hugging Face's Llama tokenizer) tokenizes each run of text between such tokens."""
    assert tok.encode(f"a{SEP}b", add_special_tokens=False) == sp.encode("a") + [sp.piece_to_id(SEP)] + sp.encode("b")


def test_bos_eos_and_space_prefix_follow_the_metadata(tmp_path, sp):
    path = _write(tmp_path / "eos.gguf", sp, {"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True})
    assert load_model_tokenizer(str(path)).encode("Hello world") == sp.encode("Hello world") + [2]
    bare = train_sentencepiece(400, add_dummy_prefix=False)
    config = llama_config(vocab_size=bare.get_piece_size(), eos_token_id=2)
    write_gguf(tmp_path / "bare.gguf", config, random_tensors_for(config, seed=42), spm=sentencepiece_metadata(bare),
               spm_keys={"tokenizer.ggml.add_space_prefix": False})
    no_prefix = load_model_tokenizer(str(tmp_path / "bare.gguf"))
    for text in ["Hello world", " leading", "the cat\nsat"]:
        assert no_prefix.encode(text) == [1] + bare.encode(text), text
        assert no_prefix.decode(no_prefix.encode(text)) == text


def test_a_tiny_llama_with_a_sentencepiece_vocabulary_generates(tmp_path, sp):
    model = load_model(str(_write(tmp_path / "chat.gguf", sp, chat_template=LLAMA2_CHAT)))
    engine = Engine(model, num_blocks=32, page_tokens=16, seed=0)
    out = engine.generate(["The capital of France is"], max_new_tokens=8)[0]
    assert out.prompt_token_ids == [1] + sp.encode("The capital of France is")
    assert len(out.token_ids) >= 1 and not any(sp.is_byte(i) for i in out.token_ids)
    prompt_text = model.tokenizer.decode(out.prompt_token_ids)       # the text continues the prompt's
    assert out.text.strip() and model.tokenizer.decode(out.prompt_token_ids + out.token_ids) == prompt_text + out.text
    # The chat template writes BOS itself; it stays one special token, [INST] is text.
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "What is the capital?"}]
    ids = model.chat_token_ids(chat)
    assert ids == ([1] + sp.encode("[INST] Hi there [/INST] Hello ") + [2]
                   + sp.encode("[INST] What is the capital? [/INST]"))
    reply = engine.generate([ids], max_new_tokens=4)[0]
    assert reply.prompt_token_ids == ids and len(reply.token_ids) >= 1


def test_streamed_text_keeps_the_space_before_the_first_word(tok, sp):
    """Decoding alone strips the space prefix of its first piece; a completion's first word is
    decoded after the prompt's last tokens, so it keeps the space that separates it."""
    prompt = tok.encode("The capital of France is")
    checker = StopChecker(tok, SamplingParams(max_new_tokens=50), prompt, [2], 100)
    answer = sp.encode("Paris, naïve 🙂")                                # "▁Paris" first, bytes last
    for n, token_id in enumerate(answer, 1):
        checker.append(token_id, n, len(prompt) + n)
    assert checker.text == " Paris, naïve 🙂" and tok.decode(answer) == "Paris, naïve 🙂"


def test_equal_scores_merge_in_id_order(tmp_path, sp):
    """gguf's converter scores every piece -1000 when the model came with a tokenizer.json only."""
    tokens, scores, types = sentencepiece_metadata(sp, [SEP])
    config = llama_config(vocab_size=len(tokens), eos_token_id=2)
    write_gguf(tmp_path / "flat.gguf", config, random_tensors_for(config, seed=44),
               spm=(tokens, [-1000.0] * len(tokens), types))
    flat = load_model_tokenizer(str(tmp_path / "flat.gguf"))
    for text in TEXTS:
        assert flat.encode(text) == [1] + sp.encode(text), text


def test_a_sentencepiece_vocabulary_without_scores_is_refused(tmp_path, sp):
    tokens, _, types = sentencepiece_metadata(sp)
    config = llama_config(vocab_size=len(tokens), eos_token_id=2)
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=43), spm=(tokens, None, types))
    with pytest.raises(CheckpointError, match=r"m.gguf: missing metadata key 'tokenizer.ggml.scores' \(a SentencePiece"):
        load_model_tokenizer(str(tmp_path / "m.gguf"))
