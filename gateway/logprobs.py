"""A choice's text and logprobs in OpenAI's shapes, piece by piece: what each streamed chunk shows,
and the whole reply's (the same numbers: the whole is its pieces' bodies joined).

- Chat (`logprobs: true`, `top_logprobs: k`): `{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [k of {"token", "logprob", "bytes"}]}], "refusal": null}`, one item per token.
- Completions (`logprobs: k`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  lists with one entry per token; `top_logprobs` maps the k most likely tokens' text, and the
  chosen token's (as OpenAI and vLLM give it: up to k + 1 entries), to their logprobs. With
  `echo` the prompt's tokens come first, the first with `null` logprob and top logprobs (nothing
  precedes it), as OpenAI and vLLM answer. `text_offset` is each token's place in the choice's
  text: the characters of the tokens before it (their `tokens` strings; with echo from the start
  of the prompt), counted across a stream's chunks.

A token's text is its bytes as UTF-8 (U+FFFD for part of a character: `bytes` has the real ones);
a logprob is the worker's float32 (worker/engine/logprobs.py)."""

from __future__ import annotations

from base.generation import Candidate, Piece, TokenLogprob

Item = tuple[bytes, "TokenLogprob | None"]  # a token's bytes, and its logprobs (None: an echoed first token)


class ChoiceText:
    """One choice's text and logprobs as its pieces come. `echo_text`: the text to echo for the prompt
    (a text prompt's own; None: the worker's reading of a token prompt). `top`: the top-k count
    asked (None: no logprobs)."""

    def __init__(self, chat: bool, top: int | None, echo: bool = False, echo_text: str | None = None):
        self.chat = chat
        self.top = top
        self.echo = echo
        self.echo_text = echo_text
        self.offset = 0  # characters of the tokens so far (completions' text_offset)
        self.texts: list[str] = []
        self.logprobs: list[dict] = []

    def piece(self, piece: Piece) -> tuple[str, dict | None]:
        """This piece's text (the prompt before it when echoed) and its logprobs body, kept for `whole`."""
        text, items = piece.text, []
        if piece.prompt is not None and self.echo:
            text = (piece.prompt.text if self.echo_text is None else self.echo_text) + text
            if self.top is not None:
                items += [(piece.prompt.first_token, None)]
                items += [(e.chosen.token, e) for e in piece.prompt.logprobs or []]
        if self.top is not None:
            items += [(e.chosen.token, e) for e in piece.logprobs or []]
        body = None if self.top is None else self._body(items)
        self.texts.append(text)
        if body is not None:
            self.logprobs.append(body)
        return text, body

    def whole(self) -> tuple[str, dict | None]:
        """The text and the logprobs body of every piece so far, joined."""
        text = "".join(self.texts)
        if self.top is None:
            return text, None
        if self.chat:
            return text, {"content": [item for body in self.logprobs for item in body["content"]], "refusal": None}
        return text, {name: [x for body in self.logprobs for x in body[name]]
                      for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

    def _body(self, items: list[Item]) -> dict:
        if self.chat:
            return {"content": [_chat_item(entry.chosen, entry.top[:self.top]) for _, entry in items], "refusal": None}
        tokens, logprobs, tops, offsets = [], [], [], []
        for token, entry in items:
            text = _text(token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(entry.chosen.logprob)
            top: dict[str, float] = {}
            for candidate in (*entry.top[:self.top], entry.chosen):
                top.setdefault(_text(candidate.token), candidate.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_item(chosen: Candidate, top: tuple[Candidate, ...]) -> dict:
    return {**_chat_candidate(chosen), "top_logprobs": [_chat_candidate(c) for c in top]}


def _chat_candidate(c: Candidate) -> dict:
    return {"token": _text(c.token), "logprob": c.logprob, "bytes": list(c.token)}


def _text(token: bytes) -> str:
    return token.decode("utf-8", errors="replace")
