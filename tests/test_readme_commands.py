"""The README's "Use it" commands, run as written, in order, in a fresh folder: what a new user
pastes must give good answers from the default model, not only exit 0. One cluster (the README's
own `cluster up --detach`) for the module, stopped by the README's `cluster down` (and by pid if
a test failed before it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_helpers import cluster_down
from kvcache.cli import build_parser
from worker.model.named import DEFAULT_MODEL, named_model_installed

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ".venv/bin/kvcache"
CLI = [sys.executable, "-m", "kvcache.cli"]

pytestmark = pytest.mark.skipif(not named_model_installed(DEFAULT_MODEL),
                                reason="the default model's package is not installed (`make install` installs it)")


def readme_commands() -> list[list[str]]:
    """The kvcache command lines of the README's "Use it" block (its `# ...` notes dropped)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [c[1:] for c in commands if c and c[0] == PROGRAM]


def summary(stderr: str) -> dict:
    """The usage line `generate` ends with, as numbers."""
    found = re.search(r"prompt (\d+) tokens: (\d+) from local cache, (\d+) from kvnodes, (\d+) computed; "
                      r"(\d+) generated", stderr)
    assert found, stderr
    return dict(zip(("prompt", "local", "remote", "computed", "generated"), map(int, found.groups())))


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    """Every command in order, in a new folder, with no cluster or session of the user's own."""
    folder = tmp_path_factory.mktemp("new-user")
    env = {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN")}
    env["KVCACHE_SESSION_DIR"] = str(folder / "sessions")
    results, members = [], []
    try:
        for command in readme_commands():
            done = subprocess.run([*CLI, *command], capture_output=True, text=True, cwd=folder, env=env,
                                  timeout=240, stdin=subprocess.DEVNULL)
            results.append((command, done))
            if command[:2] == ["cluster", "up"] and done.returncode == 0:
                members = json.loads((folder / ".kvcache" / "cluster.json").read_text())["members"]
            if done.returncode != 0:
                break
        yield results
    finally:
        cluster_down([*CLI, "cluster"], folder / ".kvcache", members)


def result(ran, *words: str) -> subprocess.CompletedProcess:
    """The run of the command whose arguments hold these words, in order."""
    for command, done in ran:
        if all(w in command for w in words) and [w for w in command if w in words] == list(words):
            assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr}"
            return done
    raise AssertionError(f"no README command with {words} ran: {[shlex.join(c) for c, _ in ran]}")


def test_the_block_starts_a_cluster_in_the_background_and_stops_it_and_every_line_parses():
    commands = readme_commands()
    assert commands[0][:2] == ["cluster", "up"] and "--detach" in commands[0]
    assert commands[-1] == ["cluster", "down"]
    for command in commands:
        build_parser().parse_args(command)
        assert "--coordinators" not in command  # the cluster file is found


def test_every_command_runs_as_written(ran):
    assert [shlex.join(c) for c, _ in ran] == [shlex.join(c) for c in readme_commands()]
    for command, done in ran:
        assert done.returncode == 0, f"{shlex.join(command)}: {done.stderr}"
        assert "Traceback" not in done.stderr


def test_a_question_gets_its_answer(ran):
    done = result(ran, "generate", "What is the capital of France?")
    assert "Paris" in done.stdout and done.stdout.endswith("\n")
    assert "using the cluster in" in done.stderr


def test_a_sessions_first_turn_is_answered_and_the_next_turn_sees_it(ran):
    first = result(ran, "--session", "--system", "What is the capital of France?")
    assert "Paris" in first.stdout
    second = result(ran, "--session", "And what is it famous for?")
    # "it" is Paris only to a model that sees the first turn.
    assert "Paris" in second.stdout or "Eiffel" in second.stdout, second.stdout
    one, two = summary(first.stderr), summary(second.stderr)
    assert two["prompt"] > one["prompt"] + one["generated"]     # the whole conversation was sent
    assert two["local"] + two["remote"] >= 16                      # and its beginning came from the cache


def test_raw_continues_the_text_without_a_template(ran):
    done = result(ran, "--raw", "Once upon a time")
    usage = summary(done.stderr)
    assert usage["prompt"] < 10 and usage["generated"] == 20  # the four words alone, no chat around them
    assert len(done.stdout.split()) >= 5


def test_status_shows_the_cluster_alive(ran):
    done = result(ran, "status")
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("node ", "worker "))]
    assert sorted(r[0] for r in rows) == ["node"] * 3 + ["worker"] * 2
    assert all(r[2] == "alive" for r in rows)


def test_down_stops_it(ran):
    done = result(ran, "cluster", "down")
    assert "stopped" in done.stdout
