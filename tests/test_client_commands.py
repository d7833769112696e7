"""The client commands as a new user meets them: unknown models get one clear line that lists
the models that work, and every help text names them."""

from __future__ import annotations

import os
import subprocess

import pytest

from cluster_helpers import kvcache_command


def clean_env(**extra: str) -> dict:
    """This process's environment without a cluster or token of the user's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN")}
    return {**env, **extra}


def kvcache(*args: str, cwd=None, env: dict | None = None, timeout: float = 120.0):
    return subprocess.run(kvcache_command(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env or clean_env(), stdin=subprocess.DEVNULL)


def test_an_unknown_model_is_refused_listing_the_models_that_work(tmp_path):
    done = kvcache("cluster", "up", "--model", "nonsense", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 2
    assert "model 'nonsense'" in done.stderr and "config.json in nonsense" not in done.stderr
    for kind in ("smollm2-135m", "tiny", "gpt2-small-shape", ".gguf file", "Hugging Face checkpoint folder"):
        assert kind in done.stderr, kind
    assert not (tmp_path / "run" / "cluster.json").exists()


@pytest.mark.parametrize("command", [["node"], ["worker"], ["cluster", "up"]])
def test_model_help_names_every_kind_of_model(command):
    done = kvcache(*command, "--help", env=clean_env(COLUMNS="400"))
    assert done.returncode == 0
    [line] = [line for line in done.stdout.splitlines() if line.strip().startswith("--model")]
    for kind in ("smollm2-135m", "tiny", "gpt2-small-shape", ".gguf"):
        assert kind in line, (kind, line)
