"""A kvnode's data folder (--data-dir): its disk tier's slot file, its node id, and a lock.

The node id is kept so a node that restarts on the same folder is the same node in logs and
`Info` (its ring position follows its address: restart it on the same --port). The page size
is kept so a node of another page size refuses the folder instead of reading its slots as
garbage. The lock (flock, released by the kernel when the process dies, also by SIGKILL)
keeps a second node off a folder in use.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from pathlib import Path

NODE_ID_FILE = "node-id"
LAYOUT_FILE = "layout.json"
LOCK_FILE = "lock"


class DataDir:
    def __init__(self, path: Path | str, page_bytes: int):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ValueError(f"--data-dir {self.path} is in use by another node") from None
        try:
            self._check_layout(page_bytes)
        except BaseException:
            self.close()
            raise

    def _check_layout(self, page_bytes: int) -> None:
        layout = self.path / LAYOUT_FILE
        if layout.exists():
            kept = json.loads(layout.read_text()).get("page_bytes")
            if kept != page_bytes:
                raise ValueError(f"--data-dir {self.path} holds pages of {kept} bytes, this node stores pages of "
                                 f"{page_bytes}: give another --data-dir, or delete that one")
        else:
            _write_atomically(layout, json.dumps({"page_bytes": page_bytes}) + "\n")

    def node_id(self, given: str | None) -> str:
        """`given` (then kept), else the id kept in the folder, else a new random one (then kept)."""
        path = self.path / NODE_ID_FILE
        if given is None and path.exists():
            kept = path.read_text().strip()
            if kept:
                return kept
        node_id = given or uuid.uuid4().hex[:12]
        _write_atomically(path, node_id + "\n")
        return node_id

    def close(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
