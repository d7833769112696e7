"""Reading the cluster file `kvcache cluster up` writes (its members, ports and secrets' paths),
for the commands that act on a running local cluster: one place for the errors a user sees."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_RUN_DIR = ".kvcache"
CLUSTER_FILE = "cluster.json"
CLIENT_TOKEN_FILE = "client.token"   # a --secure cluster's client token alone, for --token-file


class ClusterFileError(Exception):
    """What was wrong with the file, and the exit code to leave with (1: none there, 2: unreadable)."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


def read_cluster_file(cluster_file: Path, when_missing: str) -> dict:
    """The file's contents; ClusterFileError naming the file, with `when_missing` as the advice
    when there is none."""
    try:
        return json.loads(cluster_file.read_text())
    except FileNotFoundError:
        raise ClusterFileError(1, f"no cluster file at {cluster_file}: {when_missing}") from None
    except json.JSONDecodeError as exc:
        raise ClusterFileError(2, f"error: {cluster_file} is not valid JSON ({exc})") from None
