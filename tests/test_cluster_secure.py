"""`kvcache cluster up --secure`: the whole local cluster on mutual TLS with a generated token,
and the options it prints are the ones that work."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.error
import urllib.request

from kvcache.cluster import _is_ours


def test_cluster_up_secure_prints_a_token_and_options_that_work_and_plaintext_does_not(tmp_path):
    run_dir = tmp_path / "run"
    cli = [sys.executable, "-m", "kvcache.cli"]
    up = subprocess.run([*cli, "cluster", "up", "--secure", "--model", "tiny", "--run-dir", str(run_dir), "--nodes",
                         "1", "--workers", "1", "--coordinators", "1", "--replicas", "1", "--detach", "--no-metrics"],
                        capture_output=True, text=True, timeout=180)
    members = []
    try:
        assert up.returncode == 0, up.stderr
        members = json.loads((run_dir / "cluster.json").read_text())["members"]
        token = re.search(r"^token: (\S+)$", up.stdout, re.M).group(1)
        tried = re.search(r"^try: KVCACHE_TOKEN=\S+ kvcache generate (.*)$", up.stdout, re.M).group(1)
        options = shlex.split(tried)[:-1]  # without the prompt
        env = {**os.environ, "KVCACHE_TOKEN": token}
        ok = subprocess.run([*cli, "generate", *options, "--max-tokens", "2", "Hello"], capture_output=True,
                            text=True, timeout=120, env=env)
        assert ok.returncode == 0, ok.stderr
        coordinators = options[options.index("--coordinators") + 1]
        plain = subprocess.run([*cli, "generate", "--coordinators", coordinators, "--max-tokens", "2", "Hello"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        # The gateway reaches the coordinators over mutual TLS and passes each caller's key on.
        gateway = re.search(r"^gateway: (http://\S+) ", up.stdout, re.M).group(1)
        assert completion(gateway, None)[0] == 401 and completion(gateway, "not-" + token)[0] == 401
        status, body = completion(gateway, token)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        for member in members:
            assert token not in open(member["log"]).read()
    finally:
        down = subprocess.run([*cli, "cluster", "down", "--run-dir", str(run_dir)], capture_output=True, text=True,
                              timeout=120)
        for member in members:  # whatever `down` left running, by its own pid
            if _is_ours(member["pid"]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member["pid"], signal.SIGKILL)
    assert down.returncode == 0, down.stderr


def completion(gateway: str, key: str | None) -> tuple[int, dict]:
    """POST /v1/completions to the gateway with `key` as its bearer token (none when None)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{gateway}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")
