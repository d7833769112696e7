"""The served models' tokenizers, in the gateway: for vLLM's /tokenize, /detokenize and
/tokenizer_info (tokenize.py), and for the prompt's token count that continuous usage needs
before the worker reports it.

A model's name is the one its workers report, as worker.model.load_model names it: a preset's
or named model's own name, a GGUF file's stem, a folder's name. The gateway loads a model's
tokenizer by that name when it can as it is (a preset, a named model, a GGUF file or a folder
at that path), else from a --tokenizer source (the workers' --model, whose name is derived the
same way: served_name). A model it cannot load is answered 404.

Loaded on first use, in a thread (a GGUF's vocabulary takes seconds to read), once per model
however many requests ask at once; at most MAX_LOADED are kept, the least recently used goes.

Token ids are the worker's: text is encoded as the worker encodes a prompt (with the special
tokens the tokenizer adds), a chat rendered with the model's template as the worker renders it
(worker.model: the same template, bos and eos strings), then encoded without them
(Model.chat_token_ids). So a count here is usage's prompt_tokens for the same prompt.

worker.model is imported at first use, not with the gateway: it brings numpy and the model
code, which a gateway whose callers never tokenize has no use for.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import anyio

from gateway.errors import ApiError, bad_request, shown

MAX_LOADED = 4
MAX_PROMPT_CHARS_PER_TOKEN = 32   # as the worker's (worker/service.py): a longer prompt is refused unread


@dataclass
class ModelTokenizer:
    tokenizer: object                  # worker.model.tokenizer.Tokenizer
    template: object | None            # worker.model.chat.ChatTemplate
    max_model_len: int
    vocab_size: int
    info: dict                         # the body of /tokenizer_info

    def check_length(self, prompt: str | list[dict], param: str) -> None:
        """A 400 for a text or chat longer than the worker reads, before any of it is tokenized."""
        limit = self.max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) + len(m["role"]) for m in prompt)
        if chars > limit:
            raise bad_request(f"{param}: has {chars} characters; this model's context ({self.max_model_len} tokens) "
                              f"takes at most {limit}", param=param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(self, messages: list[dict], add_generation_prompt: bool = True,
             add_special_tokens: bool = False) -> list[int]:
        """A 400 in the worker's words for messages the template refuses, or a model without one."""
        from worker.model import ChatError

        if self.template is None:
            raise bad_request("this model has no chat template: send a prompt instead of messages", param="messages")
        try:
            return self.encode(self.template.render(messages, add_generation_prompt), add_special_tokens)
        except ChatError as exc:
            raise bad_request(str(exc), param="messages") from None

    def prompt_tokens(self, prompt: str | list) -> int:
        """How many tokens the worker makes of a prompt (text, token ids or chat messages)."""
        if isinstance(prompt, str):
            self.check_length(prompt, "prompt")
            return len(self.encode(prompt))
        if prompt and isinstance(prompt[0], dict):
            self.check_length(prompt, "messages")
            return len(self.chat(prompt))
        return len(prompt)

    def decode(self, ids: Sequence[int]) -> str:
        beyond = [i for i in ids if i >= self.vocab_size]
        if beyond:
            raise bad_request(f"tokens: {beyond[0]} is not a token id of this model (it has {self.vocab_size})",
                              param="tokens")
        return self.tokenizer.decode(ids)


def served_name(source: str) -> str:
    """The model name workers started with `--model source` report (worker.model.load_model's)."""
    if _by_name(source):
        return source
    path = Path(source)
    return path.stem if _is_gguf(source) else path.name or str(path)


def load(source: str) -> ModelTokenizer:
    """The tokenizer, chat template and limits of a preset, named model, GGUF file or folder."""
    from worker.model import load_model_tokenizer, read_model_config
    from worker.model.chat import ChatTemplate, folder_chat_template
    from worker.model.config import PRESETS
    from worker.model.gguf_file import read_gguf
    from worker.model.named import NAMED_GGUF, named_gguf_path

    tokenizer = load_model_tokenizer(source)
    name_of = getattr(tokenizer, "id_to_token", lambda token_id: None)   # a byte tokenizer's eos has no text
    template, bos = None, None
    gguf = named_gguf_path(source) if source in NAMED_GGUF else Path(source) if _is_gguf(source) else None
    if gguf is not None:
        g = read_gguf(gguf, with_tensors=False)
        config = g.config
        bos = name_of(g.bos_token_id) if g.bos_token_id is not None else None
        if g.chat_template:   # as worker.model._load_gguf builds it
            template = ChatTemplate(g.chat_template, bos or "", name_of(config.eos_token_id) or "")
    else:
        config = read_model_config(source)
        if source not in PRESETS:
            template = folder_chat_template(source)
            bos = (template.bos_token or None) if template is not None else None
    eos = (template.eos_token or None) if template is not None else name_of(config.eos_token_id)
    info = {"tokenizer_class": type(tokenizer).__name__, "bos_token": bos, "eos_token": eos,
            "model_max_length": config.max_positions, "chat_template": template.source if template else None}
    return ModelTokenizer(tokenizer, template, config.max_positions, config.vocab_size, info)


class Tokenizers:
    def __init__(self, sources: Sequence[str] = (), max_loaded: int = MAX_LOADED):
        """`sources`: --tokenizer's, where to load the models named after them from."""
        self._given = list(sources)
        self._sources: dict[str, str] | None = None   # by served name, at first use
        self._loaded: OrderedDict[str, ModelTokenizer] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}   # one per model ever asked for: the cluster's models bound it
        self.max_loaded = max_loaded

    def source(self, name: str) -> str | None:
        """Where `name`'s tokenizer is loaded from; None when the gateway cannot load it."""
        if self._sources is None:
            self._sources = {served_name(source): source for source in self._given}
        if name in self._sources:
            return self._sources[name]
        if _by_name(name) or Path(name).is_dir() or (_is_gguf(name) and Path(name).is_file()):
            return name
        return None

    async def get(self, name: str) -> ModelTokenizer:
        """`name`'s tokenizer, loaded at its first use, in a thread, once; ApiError 404 when it cannot be."""
        loaded = self._loaded.get(name)
        if loaded is not None:
            self._loaded.move_to_end(name)
            return loaded
        async with self._locks.setdefault(name, asyncio.Lock()):
            return self._loaded.get(name) or await self._load(name)

    async def prompt_tokens(self, name: str, prompt: str | list) -> int:
        """How many tokens the worker will make of `prompt` (continuous usage stats); a 400 naming
        stream_options when the gateway cannot load the model's tokenizer to count them."""
        if isinstance(prompt, list) and not (prompt and isinstance(prompt[0], dict)):
            return len(prompt)   # token ids: no tokenizer needed
        try:
            model = await self.get(name)
        except ApiError as exc:
            if exc.status != 404:
                raise
            raise bad_request(f"stream_options.continuous_usage_stats: the gateway counts the prompt's tokens "
                              f"itself, and {exc.message}", param="stream_options") from None
        return await anyio.to_thread.run_sync(model.prompt_tokens, prompt)

    async def _load(self, name: str) -> ModelTokenizer:
        source = self.source(name)
        if source is None:
            raise ApiError(404, f"the gateway cannot load the tokenizer of model `{shown(name)}`: start it with "
                                f"--tokenizer and the workers' --model (a GGUF file or folder)",
                           param="model", code="model_not_found")
        try:
            loaded = await anyio.to_thread.run_sync(load, source)
        except (OSError, ValueError) as exc:   # CheckpointError and ChatError are ValueErrors
            raise ApiError(404, f"the gateway cannot load the tokenizer of model `{name}` from {source}: {exc}",
                           param="model", code="model_not_found") from None
        self._loaded[name] = loaded
        while len(self._loaded) > self.max_loaded:
            self._loaded.popitem(last=False)
        return loaded


def _is_gguf(source: str) -> bool:
    return Path(source).suffix.lower() == ".gguf"   # as worker.model tells a GGUF file from a folder


def _by_name(name: str) -> bool:
    """A preset or named model: loaded by its name alone."""
    from worker.model.config import PRESETS
    from worker.model.named import NAMED_GGUF

    return name in PRESETS or name in NAMED_GGUF
