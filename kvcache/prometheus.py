"""`kvcache cluster prometheus-config`: how a Prometheus scrapes the members of a `cluster up`.

By default it prints `file_sd` targets, one group per role (label `role`), to save as a file a
scrape job names in `file_sd_configs` (deploy/grafana/prometheus.yml). With `--scrape-config` it
prints a whole Prometheus configuration (JSON, which Prometheus reads as YAML) with the targets in
it, and for a `--secure` cluster what scraping it takes: HTTPS with the cluster's CA and the
`monitor` certificate (mutual TLS) for coordinators, kvnodes and workers, and for the gateway,
whose /metrics follows its API's rule, HTTPS with the CA and the monitor token as a bearer token. A file_sd target
cannot carry TLS settings, so a secure cluster needs `--scrape-config` (or the same settings
written into the job by hand).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.cluster_file import ClusterFileError, read_cluster_file

SCRAPE_INTERVAL = "5s"


def add_arguments(parser: argparse.ArgumentParser, default_run_dir: str) -> None:
    parser.add_argument("--run-dir", default=default_run_dir,
                        help=f"where `up` wrote its cluster file (default ./{default_run_dir})")
    parser.add_argument("--scrape-config", action="store_true",
                        help="print a whole Prometheus configuration (scrape jobs with the targets, and the TLS "
                             "and token settings a --secure cluster needs) instead of file_sd targets")


def file_sd_targets(cluster: dict) -> list[dict]:
    """`file_sd_configs` target groups, one per role; members served over HTTPS carry
    `__scheme__: https` (their job still needs tls_config)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for member in cluster.get("members", []):
        url = member.get("metrics")
        if url:
            scheme, _, rest = url.partition("://")
            groups.setdefault((member["role"], scheme), []).append(rest.split("/", 1)[0])
    return [{"targets": targets, "labels": {"job": "kvcache", "role": role,
                                            **({"__scheme__": scheme} if scheme != "http" else {})}}
            for (role, scheme), targets in groups.items()]


def scrape_config(cluster: dict) -> dict:
    """A Prometheus configuration scraping every member of `cluster` (a cluster file's contents)."""
    secure = cluster.get("secure")
    members, gateway = [], []
    gateway_https = False
    for group in file_sd_targets(cluster):
        labels = {k: v for k, v in group["labels"].items() if not k.startswith("__")}
        if labels["role"] == "gateway":
            gateway_https |= group["labels"].get("__scheme__") == "https"
        (gateway if labels["role"] == "gateway" else members).append({"targets": group["targets"], "labels": labels})
    jobs = []
    if members:
        job = {"job_name": "kvcache", "static_configs": members}
        if secure:
            job |= {"scheme": "https", "tls_config": {"ca_file": secure["ca_file"], "cert_file": secure["cert_file"],
                                                      "key_file": secure["key_file"]}}
        jobs.append(job)
    if gateway:
        job = {"job_name": "kvcache-gateway", "static_configs": gateway}
        if secure:
            job["authorization"] = {"type": "Bearer", "credentials_file": secure["token_file"]}
        if gateway_https:  # a secure cluster's gateway serves HTTPS, its certificate of the cluster's CA
            job |= {"scheme": "https", **({"tls_config": {"ca_file": secure["ca_file"]}} if secure else {})}
        jobs.append(job)
    return {"global": {"scrape_interval": SCRAPE_INTERVAL}, "scrape_configs": jobs}


def run(args: argparse.Namespace, cluster_file: Path) -> int:
    name = "kvcache cluster prometheus-config"
    try:
        cluster = read_cluster_file(cluster_file, "start one with `kvcache cluster up`")
    except ClusterFileError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.exit_code
    targets = file_sd_targets(cluster)
    if not targets:
        print(f"{name}: no member in {cluster_file} serves metrics (started with --no-metrics?)", file=sys.stderr)
        return 1
    if args.scrape_config:
        print(json.dumps(scrape_config(cluster), indent=2))
        return 0
    if cluster.get("secure"):
        print(f"{name}: this cluster is secure: its scrape jobs need TLS and token settings that file_sd "
              f"targets cannot carry; --scrape-config prints a whole configuration with them", file=sys.stderr)
    print(json.dumps(targets, indent=2))
    return 0
