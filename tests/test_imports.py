"""kvnode's client loads none of the node's server: a worker, a gateway or a vLLM engine that
imports kvnode.client does not import the store, the eviction policies, the disk tier or
recovery (kvnode/client/__init__.py). Checked in a fresh interpreter, whose sys.modules no other
test has filled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("kvnode.store", "kvnode.store_types", "kvnode.eviction", "kvnode.disk_tier", "kvnode.recovery",
          "kvnode.tiers", "kvnode.leases", "kvnode.service", "kvnode.data_plane", "kvnode.daemon")


def modules_loaded_by(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement` from the repository's root."""
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60, check=True)
    return set(done.stdout.split())


def test_importing_the_kvnode_client_loads_none_of_the_server():
    loaded = modules_loaded_by("from kvnode.client import NodeClient, NodeError, NodeInfo, PageRejected, "
                               "PinnedPages, PutResult, SharedPoolFile, page_checksum")
    assert "kvnode.client.node_client" in loaded
    server = sorted(m for m in loaded if m in SERVER or m.startswith("kvnode.eviction."))
    assert not server, f"importing kvnode.client loaded the node's server modules {server}"
