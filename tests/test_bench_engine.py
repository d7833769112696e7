"""`kvcache bench engine` runs end to end (tiny models, short prompts) and reports both sides; figures are not asserted."""

import json
import subprocess
import sys

from gguf_helpers import train_tokenizer, write_gguf
from worker.model.testing import llama_config, random_tensors_for


def test_bench_engine_short_run_reports_engine_and_dense():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", "tiny", "--prompt-tokens", "48",
         "--decode-context", "16", "--decode-tokens", "2", "--batch", "2", "--repeats", "1", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["model"] == "tiny"
    assert report["prefill"]["engine_tokens_per_s"] > 0 and report["prefill"]["dense_tokens_per_s"] > 0
    assert [d["batch"] for d in report["decode"]] == [1, 2]
    assert all(d["engine_tokens_per_s"] > 0 and d["dense_tokens_per_s"] > 0 for d in report["decode"])
    ttft = report["ttft"]
    assert ttft["cached_tokens"] == 32 and ttft["cold_ms"] > 0 and ttft["warm_ms"] > 0


def test_bench_engine_rejects_bad_options():
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", "tiny", "--prompt-tokens", "4000"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2 and "exceed the model's 1024 positions" in result.stderr


def test_bench_engine_measures_a_chat_when_the_model_has_a_template(tmp_path):
    """A GGUF with ChatML in its metadata: prefill and TTFT run on a rendered chat, and warm means
    another question after the same system prompt (its pages reused)."""
    config = llama_config(vocab_size=300, eos_token_id=2, max_positions=2048)
    write_gguf(tmp_path / "chat.gguf", config, random_tensors_for(config, seed=3), tok=train_tokenizer(300))
    result = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", str(tmp_path / "chat.gguf"),
         "--prompt-tokens", "700", "--decode-context", "16", "--decode-tokens", "2", "--batch", "2",
         "--repeats", "2", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    prompts, ttft = report["prompts"], report["ttft"]
    assert prompts["kind"] == "chat" and prompts["system_rules"] >= 1
    assert prompts["system_tokens"] < prompts["tokens"] <= 700 and ttft["prompt_tokens"] <= 700
    assert prompts["system_tokens"] // 16 * 16 <= ttft["cached_tokens"] < ttft["prompt_tokens"]
    assert report["prefill"]["engine_tokens_per_s"] > 0 and ttft["warm_ms"] > 0
    too_short = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "bench", "engine", "--model", str(tmp_path / "chat.gguf"),
         "--prompt-tokens", "20"], capture_output=True, text=True, timeout=120)
    assert too_short.returncode == 2 and "the bench's chats take at least" in too_short.stderr
