"""deploy/: the Kubernetes manifests validate offline against Kubernetes' schemas (strict: no
unknown field) at a pinned version, compose.yaml against the compose specification's schema,
every kvcache command line in them parses with kvcache's own parser, and the Dockerfile
installs with the README's command."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
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
