"""Chat templates: a model's Jinja template (GGUF `tokenizer.chat_template`, or `chat_template`
in a folder's tokenizer_config.json) rendered as Hugging Face's apply_chat_template renders it:
a sandboxed jinja2 environment with trim_blocks and lstrip_blocks, the loopcontrols extension,
`raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text, and the variables
messages, add_generation_prompt, bos_token and eos_token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Iterable, Mapping

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 1024


class ChatError(ValueError):
    """Messages the template cannot render, or a model without a template; says which and why."""


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatError(f"the model's chat template does not parse: {e}") from e
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Iterable[Message | Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        import jinja2

        checked = check_messages(messages)
        try:
            return self._template.render(messages=[{"role": m.role, "content": m.content} for m in checked],
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.exceptions.TemplateError as e:
            raise ChatError(f"the model's chat template refused these messages: {e}") from e


def check_messages(messages: Iterable[Message | Mapping[str, str]]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, Mapping):
            m = Message(m.get("role", ""), m.get("content", ""))
        if m.role not in ROLES:
            raise ChatError(f"message {i}: role {m.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m.content, str):
            raise ChatError(f"message {i}: content should be text")
        out.append(m)
        if len(out) > MAX_MESSAGES:
            raise ChatError(f"more than {MAX_MESSAGES} messages")
    if not out:
        raise ChatError("a chat needs at least one message")
    return out


def folder_chat_template(folder) -> ChatTemplate | None:
    """The template in a checkpoint folder's tokenizer_config.json (a string, or a list of named
    templates of which "default" is used), with its bos/eos tokens; None when there is none."""
    from pathlib import Path

    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ChatError(f"{path}: not readable JSON ({e})") from e
    source = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(source, list):
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None

    def token(key):
        value = config.get(key)
        return value.get("content", "") if isinstance(value, dict) else value if isinstance(value, str) else ""

    return ChatTemplate(source, token("bos_token"), token("eos_token"))
