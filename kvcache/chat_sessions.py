"""The turns of `kvcache generate --chat --session ID`, kept on the client's machine: a JSON file
per session under $KVCACHE_SESSION_DIR (default: $XDG_STATE_HOME/kvcache/sessions, or
~/.local/state/kvcache/sessions). Each turn sends the whole conversation, so its rendered prompt
extends the previous turn's and the cache serves everything before the new message."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path


def session_dir() -> Path:
    if os.environ.get("KVCACHE_SESSION_DIR"):
        return Path(os.environ["KVCACHE_SESSION_DIR"])
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "kvcache" / "sessions"


@dataclass
class ChatSession:
    session_id: str
    path: Path
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def open(cls, session_id: str) -> "ChatSession":
        # The file name is a digest: any session id is a safe name.
        path = session_dir() / (hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest() + ".json")
        if not path.is_file():
            return cls(session_id, path)
        try:
            data = json.loads(path.read_text())
            messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in data["messages"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"session file {path} is unreadable ({e}); delete it to start the session again") from e
        return cls(session_id, path, messages)

    def save_turn(self, messages: list[dict], answer: str) -> None:
        """Keep the messages sent and the assistant's answer (written whole, then renamed)."""
        self.messages = [*messages, {"role": "assistant", "content": answer}]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"session_id": self.session_id, "messages": self.messages}, ensure_ascii=False))
        tmp.replace(self.path)
