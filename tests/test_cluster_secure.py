"""`kvcache cluster up --secure`: the whole local cluster on mutual TLS with a generated token;
a client given its run directory finds the CA and token, and the options it prints for elsewhere
(the CA and the token, no client certificate) are the ones that work; the gateway serves HTTPS
to the openai client given the CA and the token as its key, and plain HTTP a 400 naming https://; its
metrics ports too, scraped the way the configuration `prometheus-config --scrape-config` prints
tells Prometheus to."""

from __future__ import annotations

import json
import os
import re
import shlex
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest

from cluster_helpers import cluster_down
from kvcache.launch import Daemon
from metrics_helpers import scrape, tls_context


def test_cluster_up_secure_prints_a_token_and_options_that_work_and_plaintext_does_not(tmp_path):
    run_dir = tmp_path / ".kvcache"  # the folder's own: a gateway started in tmp_path finds it
    cli = [sys.executable, "-m", "kvcache.cli"]
    up = subprocess.run([*cli, "cluster", "up", "--secure", "--model", "tiny", "--run-dir", str(run_dir), "--nodes",
                         "1", "--workers", "1", "--coordinators", "1", "--replicas", "1", "--detach"],
                        capture_output=True, text=True, timeout=180)
    members = []
    try:
        assert up.returncode == 0, up.stderr
        members = json.loads((run_dir / "cluster.json").read_text())["members"]
        token = re.search(r"^token: (\S+) \(alone in (\S+), for a client's --token-file\)$", up.stdout, re.M)
        token, token_file = token.group(1), token.group(2)
        assert Path(token_file).read_text().strip() == token and Path(token_file).stat().st_mode & 0o077 == 0
        # Given its run directory, a client finds the coordinators, certificates and token itself.
        assert re.search(rf'^try: kvcache generate --run-dir {re.escape(str(run_dir))} "Hello"$', up.stdout, re.M)
        found = subprocess.run([*cli, "generate", "--run-dir", str(run_dir), "--max-tokens", "2", "Hello"],
                               capture_output=True, text=True, timeout=120, env=env_without_client_settings())
        assert found.returncode == 0, found.stderr
        assert "TLS with the CA and client token of its run directory" in found.stderr
        # From elsewhere: the printed options, the CA and the token from its file (no client certificate).
        printed = re.search(r"^client options elsewhere: (.*)$", up.stdout, re.M).group(1)
        options = shlex.split(printed)
        assert options[options.index("--token-file") + 1] == token_file
        ca = Path(options[options.index("--tls-ca") + 1])
        assert ca.name == "ca.pem" and "--tls-cert" not in options and "--tls-key" not in options
        ok = subprocess.run([*cli, "generate", *options, "--max-tokens", "2", "Hello"], capture_output=True,
                            text=True, timeout=120, env=env_without_client_settings())
        assert ok.returncode == 0, ok.stderr
        # The daemons' tokens file works as a client's token file too: its `default` tenant is the clients'.
        tokens_file = subprocess.run([*cli, "status", *options, "--token-file", str(run_dir / "tokens")],
                                     capture_output=True, text=True, timeout=120, env=env_without_client_settings())
        assert tokens_file.returncode == 0, tokens_file.stderr
        env = {**env_without_client_settings(), "KVCACHE_TOKEN": token}
        coordinators = options[options.index("--coordinators") + 1]
        plain = subprocess.run([*cli, "generate", "--coordinators", coordinators, "--max-tokens", "2", "Hello"],
                               capture_output=True, text=True, timeout=120, env=env)
        assert plain.returncode == 1 and plain.stderr.splitlines() == [
            f"kvcache generate: error: the cluster at {coordinators.split(',')[0]} speaks TLS and this client does "
            f"not: pass --tls-ca FILE, the cluster's CA (`kvcache cluster up --secure` wrote RUN_DIR/tls/ca.pem; in "
            f"Python Client(tls_ca=FILE)), and its token"], plain.stderr
        # The gateway serves HTTPS with the cluster's certificates, reaches the coordinators over TLS and
        # passes each caller's key on; plain HTTP to its port gets a 400 saying to use https://.
        gateway = re.search(r"^gateway: (https://\S+) ", up.stdout, re.M).group(1)
        trusted = tls_context(ca)
        assert completion(gateway, None, trusted)[0] == 401 and completion(gateway, "not-" + token, trusted)[0] == 401
        status, body = completion(gateway, token, trusted)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        with httpx2.Client(verify=trusted) as http:  # the CA as an SSLContext (verify=<path> is deprecated)
            client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=token, http_client=http, max_retries=0, timeout=60)
            assert [model.id for model in client.models.list()] == ["tiny"]
            reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=2, temperature=0)
            assert reply.usage.completion_tokens == 2
        with httpx2.Client() as http:  # the system's CAs only: the gateway's certificate is not theirs
            with pytest.raises(openai.APIConnectionError):
                openai.OpenAI(base_url=f"{gateway}/v1", api_key=token, http_client=http, max_retries=0).models.list()
        with pytest.raises(urllib.error.HTTPError) as plain:
            scrape(gateway.replace("https://", "http://", 1) + "/health")
        assert plain.value.code == 400 and f"send the request to {gateway}/health" in plain.value.read().decode()
        gateway_log = next(m["log"] for m in members if m["role"] == "gateway")
        assert "Traceback" not in open(gateway_log).read()
        # A gateway started in the cluster's folder finds it, its CA and the gateway certificate by its file.
        with Daemon("gateway", ["--port", "0"], log_path=tmp_path / "gateway-here.log", cwd=tmp_path,
                    env=env_without_client_settings()) as here:
            here_url = here.address  # as it printed it: https://HOST:PORT
            assert completion(here_url, token, trusted)[0] == 200 and completion(here_url, None, trusted)[0] == 401
            here.stop(timeout_s=10.0)
        assert "TLS with its CA, HTTPS with its gateway certificate" in (tmp_path / "gateway-here.log").read_text()
        printed = subprocess.run([*cli, "cluster", "prometheus-config", "--scrape-config", "--run-dir", str(run_dir)],
                                 capture_output=True, text=True, timeout=60)
        assert printed.returncode == 0, printed.stderr
        scrape_as_configured(json.loads(printed.stdout), members)
        for member in members:
            assert token not in open(member["log"]).read()
    finally:
        down = cluster_down([*cli, "cluster"], run_dir, members)
    assert down.returncode == 0, down.stderr


def env_without_client_settings() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("KVCACHE_COORDINATORS", "KVCACHE_TOKEN")}


def completion(gateway: str, key: str | None, context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """POST /v1/completions to the gateway with `key` as its bearer token (none when None)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"{gateway}/v1/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def scrape_as_configured(config: dict, members: list[dict]) -> None:
    """Scrape every member as the printed Prometheus configuration says (its tls_config, its bearer
    token file), and check that nobody without them gets the metrics."""
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvcache", "kvcache-gateway"}
    tls = jobs["kvcache"]["tls_config"]
    ca, monitor = tls["ca_file"], tls_context(tls["ca_file"], tls["cert_file"], tls["key_file"])
    client = tls_context(ca, Path(ca).with_name("client.pem"), Path(ca).with_name("client.key"))
    scraped = []
    for group in jobs["kvcache"]["static_configs"]:
        role = group["labels"]["role"]
        for target in group["targets"]:
            url = f"{jobs['kvcache']['scheme']}://{target}/metrics"
            assert url.startswith("https://")
            assert any(n.startswith(f"kvcache_{role}_") for n in scrape(url, context=monitor).names()), role
            refused(f"http://{target}/metrics")                # plaintext
            refused(url, context=tls_context(ca))              # TLS without a client certificate
            with pytest.raises(urllib.error.HTTPError) as forbidden:
                scrape(url, context=client)                    # a certificate of the CA, not a scraper's
            assert forbidden.value.code == 403 and b"kvcache-monitor" in forbidden.value.read()
            scraped.append(role)
    assert sorted(scraped) == sorted(m["role"] for m in members if m["role"] != "gateway")
    gateway = jobs["kvcache-gateway"]
    [group] = gateway["static_configs"]
    [target] = group["targets"]
    monitor_token = Path(gateway["authorization"]["credentials_file"]).read_text().strip()
    assert gateway["scheme"] == "https"
    url, trusted = f"https://{target}/metrics", tls_context(gateway["tls_config"]["ca_file"])
    assert any(n.startswith("kvcache_gateway_") for n in scrape(url, token=monitor_token, context=trusted).names())
    for key in (None, "not-" + monitor_token):
        with pytest.raises(urllib.error.HTTPError) as unauthorized:
            scrape(url, token=key, context=trusted)
        assert unauthorized.value.code == 401


def refused(url: str, **kwargs) -> None:
    """The connection fails before any HTTP answer (not a 4xx: no answer at all)."""
    try:
        scrape(url, **kwargs)
    except urllib.error.HTTPError as error:
        raise AssertionError(f"{url} answered HTTP {error.code}; expected no answer") from None
    except OSError:
        return
    raise AssertionError(f"{url} served metrics")
