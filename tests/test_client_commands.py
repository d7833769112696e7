"""The client commands as a new user meets them: `generate` and `status` find the cluster that
`kvcache cluster up` started in the folder (or --run-dir), say which one they used and what to do
when there is none; a prompt goes as a chat unless --raw (plain text for a model without a
template); bad numbers, unknown models and readers that leave early (`| head`) each get one
clear line, never a traceback; `status` says what its columns count."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from cluster_helpers import cluster_down, kvcache_command
from kvcache.launch import Daemon

CLI = [sys.executable, "-m", "kvcache.cli"]


def clean_env(**extra: str) -> dict:
    """This process's environment without a cluster or token of the user's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN")}
    return {**env, **extra}


def kvcache(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 120.0):
    return subprocess.run(kvcache_command(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env or clean_env(), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder where `kvcache cluster up --detach` started a small cluster of the tiny model
    (no chat template) into ./.kvcache, as a user would; stopped when the module ends."""
    folder = tmp_path_factory.mktemp("user")
    up = kvcache("cluster", "up", "--detach", "--model", "tiny", "--nodes", "1", "--workers", "1",
                 "--coordinators", "1", "--replicas", "1", cwd=folder, timeout=180)
    run_dir = folder / ".kvcache"
    members = json.loads((run_dir / "cluster.json").read_text())["members"] if up.returncode == 0 else []
    try:
        assert up.returncode == 0, up.stderr
        assert re.search(r'^try: kvcache generate "Hello"$', up.stdout, re.M), up.stdout  # no options to copy
        yield folder
    finally:
        cluster_down([*CLI, "cluster"], run_dir, members)


def test_generate_finds_the_cluster_started_in_its_folder_and_says_so(folder):
    done = kvcache("generate", "--max-tokens", "4", "Hello", cwd=folder)
    assert done.returncode == 0, done.stderr
    cluster_file = folder / ".kvcache" / "cluster.json"
    assert done.stderr.splitlines()[0].startswith(f"using the cluster in {cluster_file} (coordinators 127.0.0.1:")
    # tiny has no chat template: the prompt went as plain text, and the user is told.
    assert "no chat template: the prompt goes as plain text (--raw)" in done.stderr
    assert done.stdout.endswith("\n") and done.stdout.count("\n") >= 1  # the answer ends its line, piped too


def test_explicit_chat_or_system_on_a_model_without_template_is_refused_not_sent_raw(folder):
    chat = kvcache("generate", "--max-tokens", "2", "--chat", "Hello", cwd=folder)
    assert chat.returncode == 1 and "model 'tiny' has no chat template" in chat.stderr
    system = kvcache("generate", "--max-tokens", "2", "--system", "Be brief.", "Hello", cwd=folder)
    assert system.returncode == 1 and "no chat template" in system.stderr
    raw = kvcache("generate", "--raw", "--max-tokens", "2", "--json", "Hello", cwd=folder)
    assert raw.returncode == 0 and "no chat template" not in raw.stderr
    assert json.loads(raw.stdout)["usage"]["prompt_tokens"] == len(b"Hello")  # tiny's tokens are bytes


def test_status_finds_the_cluster_here_or_by_run_dir_and_says_what_its_columns_count(folder, tmp_path):
    here = kvcache("status", cwd=folder)
    assert here.returncode == 0, here.stderr
    assert "using the cluster in" in here.stderr
    header = next(line for line in here.stdout.splitlines() if line.startswith("role"))
    assert header.split() == ["role", "address", "state", "size/model", "holds", "activity"]
    worker = next(line for line in here.stdout.splitlines() if line.startswith("worker"))
    assert re.search(r"\d+/\d+ blocks in use +running \d+, waiting \d+, in flight \d+", worker), worker
    assert "routed" not in here.stdout
    assert "cached ones are free" in here.stdout and "in flight from here" in here.stdout
    elsewhere = kvcache("status", "--json", "--run-dir", str(folder / ".kvcache"), cwd=tmp_path)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert sorted(m["role"] for m in json.loads(elsewhere.stdout)["members"]) == ["node", "worker"]


def test_a_gateway_started_here_serves_the_cluster_of_the_folders_file_and_says_so(folder, tmp_path):
    with Daemon("gateway", ["--port", "0"], log_path=tmp_path / "gateway.log", cwd=folder, env=clean_env()) as gateway:
        models = httpx2.get(f"{gateway.address}/v1/models", timeout=30.0)
        counted = httpx2.post(f"{gateway.address}/tokenize", json={"prompt": "Hello"}, timeout=30.0)
        gateway.stop(timeout_s=10.0)
    log = (tmp_path / "gateway.log").read_text()
    coordinators = [m["address"] for m in json.loads((folder / ".kvcache" / "cluster.json").read_text())["members"]
                    if m["role"] == "coordinator"]
    assert f"using the cluster in {folder / '.kvcache' / 'cluster.json'} (coordinators {coordinators[0]}" in log
    assert f"coordinators {','.join(coordinators)}," in log  # its start line
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"], models.text
    assert counted.status_code == 200 and counted.json()["count"] == len(b"Hello"), counted.text


def test_the_environment_names_the_cluster_before_the_folders_file(folder):
    done = kvcache("status", cwd=folder, env=clean_env(KVCACHE_COORDINATORS="127.0.0.1:1"))
    assert done.returncode == 1 and "127.0.0.1:1" in done.stderr and "using the cluster" not in done.stderr


def test_without_a_cluster_file_or_coordinators_one_line_says_what_to_do(tmp_path):
    for command in (["generate", "Hello"], ["status"]):
        done = kvcache(*command, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
        assert "kvcache cluster up" in done.stderr and "--coordinators" in done.stderr
        assert "Connection refused" not in done.stderr


def test_a_stale_cluster_file_names_itself_and_how_to_clear_it(tmp_path):
    run_dir = tmp_path / ".kvcache"
    run_dir.mkdir()
    (run_dir / "cluster.json").write_text(json.dumps(
        {"members": [{"role": "coordinator", "address": "127.0.0.1:1", "pid": 0, "log": "x"}]}))
    done = kvcache("status", cwd=tmp_path)
    assert done.returncode == 1
    assert f"addresses from {run_dir / 'cluster.json'}" in done.stderr and "kvcache cluster down" in done.stderr


@pytest.mark.parametrize("option, value, message", [
    ("--max-tokens", "-5", "--max-tokens must be at least 1, got -5"),
    ("--max-tokens", "0", "--max-tokens must be at least 1, got 0"),
    ("--max-tokens", str(2**40), "more than any worker allows"),
    ("--top-k", "-1", "--top-k must be 0 (all tokens) or a number of tokens, got -1"),
    ("--seed", "-1", "--seed must be between 0 and 2^64-1, got -1"),
    ("--priority", str(2**31), "--priority must be between"),
    ("--top-p", "0", "--top-p must be more than 0 and at most 1"),
    ("--temperature", "nan", "--temperature must be 0 (greedy) or more"),
])
def test_numbers_out_of_range_are_refused_naming_the_option(tmp_path, option, value, message):
    done = kvcache("generate", "--coordinators", "127.0.0.1:1", option, value, "Hello", cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "Value out of range" not in done.stderr


def test_a_malformed_token_file_is_refused_naming_the_line_never_the_token(tmp_path):
    token = "s3cret-token-of-the-default-tenant"
    (tmp_path / "tokens").write_text(f"default {token}\nmonitor {token} extra\n")
    done = kvcache("status", "--coordinators", "127.0.0.1:1", "--token-file", str(tmp_path / "tokens"))
    assert done.returncode == 2
    assert f"--token-file {tmp_path / 'tokens'} line 2: expected the token alone, or `TENANT TOKEN [shared]` " \
           "lines" in done.stderr, done.stderr
    assert token not in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_model_is_refused_listing_the_models_that_work(tmp_path):
    done = kvcache("cluster", "up", "--model", "nonsense", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert "model 'nonsense'" in done.stderr and "config.json in nonsense" not in done.stderr
    for kind in ("smollm2-135m", "tiny", "gpt2-small-shape", ".gguf file", "Hugging Face checkpoint folder"):
        assert kind in done.stderr, kind
    assert not (tmp_path / "run" / "cluster.json").exists()


@pytest.mark.parametrize("command", [["node"], ["worker"], ["cluster", "up"], ["bench", "chaos"],
                                     ["bench", "determinism"]])
def test_model_help_names_every_kind_of_model(command):
    done = kvcache(*command, "--help", env=clean_env(COLUMNS="400"))
    assert done.returncode == 0
    [line] = [line for line in done.stdout.splitlines() if line.strip().startswith("--model")]
    for kind in ("smollm2-135m", "tiny", "gpt2-small-shape", ".gguf"):
        assert kind in line, (kind, line)


def reader_gone(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `kvcache ARGS` with its stdout a pipe whose reader has left before it writes (`| head`
    after its lines): deterministic, unlike a real head."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(kvcache_command(*args), stdout=write, stderr=subprocess.PIPE, text=True, cwd=cwd,
                              env=clean_env(), timeout=120, stdin=subprocess.DEVNULL)
    finally:
        os.close(write)


@pytest.mark.parametrize("command", [["cluster", "prometheus-config", "--scrape-config"], ["status", "--json"],
                                     ["generate", "--max-tokens", "3", "Hello"], ["--help"]])
def test_a_reader_that_leaves_early_ends_the_command_quietly(folder, command):
    done = reader_gone(*command, cwd=folder)
    # 141 as a shell shows for SIGPIPE; argparse's --help hides the failed write itself and exits 0.
    assert done.returncode == (0 if command == ["--help"] else 141), done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr and "Exception ignored" not in done.stderr
