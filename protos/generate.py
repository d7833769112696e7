"""Regenerate the committed gRPC stubs from the .proto files.

protoc writes imports relative to its -I root, so the root is the project folder
and the proto path equals the Python package path (`from protos import kvcache_pb2`).
"""

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_FILES = ["protos/kvcache.proto"]


def generate(root: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for proto in PROTO_FILES:
        args = [
            "protoc",
            f"-I{root}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--pyi_out={out}",
            str(root / proto),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


if __name__ == "__main__":
    project = Path(__file__).resolve().parent.parent
    generate(project, Path(sys.argv[1]) if len(sys.argv) > 1 else project)
