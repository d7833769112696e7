"""deploy/: the Kubernetes manifests validate offline against Kubernetes' schemas (strict: no
unknown field) at a pinned version, compose.yaml against the compose specification's schema,
every kvcache command line in them parses with kvcache's own parser, and the Dockerfile
installs with the README's command; the systemd unit starts a node that can join a cluster, and
the image's build context leaves out keys, tokens and local environments."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvcache.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.35.0"  # pinned: a recent release the installed kubernetes-validate ships schemas for
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", [])


def kvcache_argv(command: list[str]) -> list[str] | None:
    """The arguments after `kvcache` of a container's command line (also one a shell runs with
    `exec kvcache ...`), None when it runs something else."""
    if command[:2] == ["sh", "-c"]:
        script = command[2]
        if not script.startswith("exec kvcache "):
            return None
        command = shlex.split(script[len("exec "):])
    return command[1:] if command and command[0] == "kvcache" else None


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_validates_against_the_kubernetes_schemas(path):
    docs = documents(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]


def test_the_manifests_hold_each_part_of_the_cluster():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for p in MANIFESTS for doc in documents(p)}
    assert {("Deployment", "kvcache-coordinator-a"), ("Service", "kvcache-coordinator-a"),
            ("StatefulSet", "kvcache-node"), ("Service", "kvcache-node"), ("Deployment", "kvcache-worker"),
            ("Deployment", "kvcache-gateway"), ("Service", "kvcache-gateway")} <= kinds
    node = next(d for p in MANIFESTS for d in documents(p) if d["kind"] == "StatefulSet")
    assert node["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    headless = next(d for p in MANIFESTS for d in documents(p)
                    if d["kind"] == "Service" and d["metadata"]["name"] == node["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def test_every_kvcache_command_line_parses_and_probes_ask_the_port_it_serves():
    parser = build_parser()
    seen = set()
    for path in MANIFESTS:
        for doc in documents(path):
            for container in containers(doc):
                argv = kvcache_argv(container.get("command", []) + container.get("args", []))
                if argv is None:
                    continue
                args = parser.parse_args(argv)  # an unknown flag or a bad value exits here
                seen.add(argv[0])
                resources_ = container["resources"]
                assert resources_["requests"]["cpu"] and resources_["requests"]["memory"], container["name"]
                if argv[0] == "gateway":
                    continue
                assert args.host == "0.0.0.0" and (argv[0] == "coordinator" or args.advertise)
                assert args.tls_cert and args.tls_key and args.tls_ca  # from the kvcache-tls Secret
                for probe in ("readinessProbe", "livenessProbe"):
                    probe_argv = kvcache_argv(container[probe]["exec"]["command"])
                    health = parser.parse_args(probe_argv)
                    assert probe_argv[0] == "health" and health.address == f"127.0.0.1:{args.port}"
                    assert (health.tls_cert, health.tls_key) == (args.tls_cert, args.tls_key)
    assert seen == {"coordinator", "node", "worker", "gateway"}


def test_compose_validates_against_the_compose_specification():
    schema_file = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    jsonschema.validators.validator_for(schema)(schema).validate(compose)
    parser = build_parser()
    for name, service in compose["services"].items():
        argv = kvcache_argv(service["command"])
        args = parser.parse_args(argv)
        if argv[0] in ("node", "worker"):
            assert args.advertise.startswith(f"{name}:"), name  # the service name is the host others dial


def test_the_gateway_loads_the_tokenizer_of_the_model_the_workers_run():
    """/tokenize and /detokenize load the workers' model's tokenizer from --tokenizer (a named model
    would load without it; a file or folder given to the workers would not)."""
    parser = build_parser()
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    setups = {"k8s": [kvcache_argv(c.get("command", []) + c.get("args", [])) for p in MANIFESTS
                      for doc in documents(p) for c in containers(doc)],
              "compose": [kvcache_argv(service["command"]) for service in compose["services"].values()]}
    for name, argvs in setups.items():
        parsed = [parser.parse_args(argv) for argv in argvs if argv]
        models = {args.model for args in parsed if args.command == "worker"}
        [gateway] = [args for args in parsed if args.command == "gateway"]
        assert models and gateway.tokenizer == sorted(models), name


def test_the_dockerfile_installs_with_the_readmes_command():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "RUN make install" in dockerfile
    assert "make install" in (ROOT / "README.md").read_text()


def test_kustomize_builds_the_base_into_the_kvcache_namespace():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` (offline) not tried")
    built = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    assert len(docs) == sum(len(documents(p)) for p in MANIFESTS)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "kvcache"


# ------------------------------------------------------------------ systemd unit, .dockerignore

UNIT = ROOT / "deploy" / "kvcache-node.service"
UNIT_ENV = ROOT / "deploy" / "kvcache-node.env"


def unit_exec_start(unit_text: str) -> str:
    """The ExecStart= command line, its continuation lines joined as systemd joins them."""
    joined = re.sub(r"\\\n\s*", " ", unit_text)
    [line] = [l for l in joined.splitlines() if l.startswith("ExecStart=")]
    return line[len("ExecStart="):]


def systemd_argv(command: str, env: dict[str, str]) -> list[str]:
    """Split as systemd does with an EnvironmentFile: ${VAR} is one word, a lone $VAR is split at
    whitespace (none when empty)."""
    argv = []
    for word in shlex.split(command):
        lone = re.fullmatch(r"\$(\w+)", word)
        if lone:
            argv += env.get(lone.group(1), "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


def env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_the_node_unit_starts_a_node_that_registers_with_page_sized_for_the_model():
    """A node without --coordinators is known to no one, and one whose page size matches no
    model's serves no worker: the unit takes both from its EnvironmentFile and --model."""
    from kvcache.model_pages import model_page_bytes

    text = UNIT.read_text()
    assert "EnvironmentFile=/etc/kvcache/node.env" in text and "deploy/kvcache-node.env" in text
    env = env_file(UNIT_ENV)
    argv = systemd_argv(unit_exec_start(text), env)
    assert argv[0] == "/opt/kvcache/.venv/bin/kvcache" and argv[1] == "node"
    args = build_parser().parse_args(argv[1:])
    assert args.coordinators == env["KVCACHE_COORDINATORS"] and "," in args.coordinators
    assert args.host == "0.0.0.0" and args.advertise == env["KVCACHE_ADVERTISE"]
    assert args.model == env["KVCACHE_MODEL"] == "smollm2-135m" and args.data_dir
    assert "--page-bytes" not in argv  # the size comes from --model (cli._run_node)
    model_page_bytes(args.model)
    with_tls = systemd_argv(unit_exec_start(text), {**env, "KVCACHE_NODE_OPTIONS": "--tls-ca a --tls-cert b --tls-key c"})
    assert build_parser().parse_args(with_tls[1:]).tls_ca == "a"


def test_systemd_reads_the_node_unit_without_a_complaint(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    env = tmp_path / "node.env"
    env.write_text(UNIT_ENV.read_text())
    kvcache = shutil.which("kvcache") or sys.executable  # the unit's /opt path exists only where installed
    unit = tmp_path / "kvcache-node.service"
    unit.write_text(UNIT.read_text().replace("/opt/kvcache/.venv/bin/kvcache", kvcache)
                    .replace("/etc/kvcache/node.env", str(env)))
    checked = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [l for l in checked.stderr.splitlines() if "kvcache-node" in l and "User" not in l]
    assert checked.returncode == 0 and not complaints, checked.stderr


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule (moby's patternmatcher): a path is left out of the build context when a
    pattern matches it or a folder above it; `**` matches any folders, `*` and `?` none of `/`."""
    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out + "$")

    compiled = [regex(p.strip("/")) for p in patterns]
    parts = path.split("/")
    return any(r.match("/".join(parts[:n])) for r in compiled for n in range(1, len(parts) + 1))


def test_the_image_build_context_leaves_out_keys_tokens_and_local_environments():
    patterns = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
                if l.strip() and not l.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # the rule above has no exceptions to follow
    secret = [".kvcache/tls/ca.key", ".kvcache/tokens", ".kvcache/client.token", ".kvcache/cluster.json",
              "run/.kvcache/tls/client.pem", "tls/ca.key", "ca.key", "tls/node.pem", "deploy/tokens",
              "somewhere/monitor.token", ".venv/bin/python", ".venv-vllm/lib/x.py", ".git/config"]
    kept = ["Makefile", "pyproject.toml", "Dockerfile", "protos/tokens.py", "kvcache/cli.py",
            "tests/test_security_tokens.py", "deploy/kvcache-node.service", "README.md"]
    assert [p for p in secret if not dockerignore_excludes(patterns, p)] == []
    assert [p for p in kept if dockerignore_excludes(patterns, p)] == []
