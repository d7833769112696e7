"""The import rules of the house, so they stay true.

1. Each part imports only the parts below it: protos (the wire contract) < base (what they all
   share) < kvnode < worker < coordinator < gateway, vllm_connector < kvcache (the command line).
   Read from the source (ast), every import, at the top or inside a function.
   Inside worker/ and kvnode/ the same holds for their folders (INNER_FLOORS); the modules at
   a part's top (its daemon, service, metrics) may import any of its folders.
2. No import circles between modules; a circle is a pair of files that cannot be read apart.
3. kvnode's client loads none of the node's server: a worker, a gateway or a vLLM engine that
   imports kvnode.client does not import the store, the eviction policies, the disk tier or
   recovery (kvnode/client/__init__.py). Checked in a fresh interpreter, whose sys.modules no
   other test has filled."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("kvnode.store", "kvnode.eviction", "kvnode.disk", "kvnode.service", "kvnode.data_plane",
          "kvnode.daemon")
# From the ground up; a part may import those on lower floors, none on its own floor or above.
FLOORS = [("protos",), ("base",), ("kvnode",), ("worker",), ("coordinator",), ("gateway", "vllm_connector"),
          ("kvcache",)]
PARTS = [part for floor in FLOORS for part in floor]
INNER_FLOORS = {
    "worker": [("worker.kv",), ("worker.model", "worker.connector"), ("worker.engine",), ("worker.remote",)],
    "kvnode": [("kvnode.wire",), ("kvnode.eviction", "kvnode.disk"), ("kvnode.store",),
               ("kvnode.data_plane", "kvnode.client")],
}


def source_modules() -> dict[str, Path]:
    """Every module of the parts by dotted name (a package by its own name)."""
    modules = {}
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_by(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules `name` imports: `from a import b` names a.b when that is a module, else a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: from the package holding `name`
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                module = ".".join(package + ([module] if module else []))
            found.update(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                         for alias in node.names)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imported_by(name, path, modules) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Modules that import each other in a loop (Tarjan's strongly connected components of two or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_scan_reads_the_imports_it_must():
    graph = import_graph()
    assert "base.member" in graph["kvnode.daemon"] and "protos.kvcache_pb2" in graph["base.member"]
    assert "kvcache.cluster" in graph["kvcache.bench.observability_cost"]  # an import inside a function
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_each_part_imports_only_the_parts_below_it():
    floor_of = {part: number for number, floor in enumerate(FLOORS) for part in floor}
    wrong = sorted(f"{name} imports {target}" for name, targets in import_graph().items() for target in targets
                   if (part := name.split(".")[0]) != (other := target.split(".")[0])
                   and other in floor_of and floor_of[other] >= floor_of[part])
    assert not wrong, "imports that run sideways or up (parts from the ground: " \
                      f"{' < '.join('/'.join(floor) for floor in FLOORS)}):\n" + "\n".join(wrong)


def folder_of(name: str, part: str) -> str | None:
    """The folder of `part` that holds module `name` (None for a module at the part's top)."""
    folders = {folder for floor in INNER_FLOORS[part] for folder in floor}
    return next((f for f in folders if name == f or name.startswith(f + ".")), None)


def test_each_folder_of_worker_and_kvnode_imports_only_the_folders_below_it():
    wrong = []
    for part, floors in INNER_FLOORS.items():
        floor_of = {folder: number for number, floor in enumerate(floors) for folder in floor}
        for name, targets in import_graph().items():
            if not name.startswith(part + "."):
                continue
            own = folder_of(name, part)
            for target in targets:
                if own is None or not target.startswith(part + "."):
                    continue  # the part's top modules may import any of its folders
                other = folder_of(target, part)
                if other is None:
                    wrong.append(f"{name} imports {target} (the part's top, above every folder)")
                elif other != own and floor_of[other] >= floor_of[own]:
                    wrong.append(f"{name} imports {target}")
    assert not wrong, "folders importing sideways or up:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    new = [sorted(c) for c in circles(import_graph())]
    assert not new, f"modules that import each other in a loop: {new}"


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
    server = sorted(m for m in loaded if any(m == s or m.startswith(s + ".") for s in SERVER))
    assert not server, f"importing kvnode.client loaded the node's server modules {server}"
