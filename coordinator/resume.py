"""How a request continues on another worker after some of its tokens were sent.

Today's contract: the next worker sees the sent tokens as prompt (resume_token_ids) and is
asked for the rest; its usage then counts them as prompt, so the relay counts them back as
completion. One function each, so the contract can change in one place.
"""

from __future__ import annotations

from protos import kvcache_pb2 as pb


def resumed(request: pb.GenerateRequest, sent: list[int]) -> pb.GenerateRequest:
    """`request` continued after the tokens already `sent` to the client."""
    attempt = pb.GenerateRequest()
    attempt.CopyFrom(request)
    attempt.resume_token_ids.extend(sent)
    attempt.max_tokens = request.max_tokens - len(sent)
    return attempt


def rewrite_usage(reply: pb.GenerateReply, attempt: pb.GenerateRequest, request: pb.GenerateRequest) -> None:
    """On the final reply of a resumed attempt: the worker saw the resumed tokens as prompt."""
    if reply.finish_reason and attempt.resume_token_ids:
        reply.usage.prompt_tokens -= len(attempt.resume_token_ids)
        reply.usage.completion_tokens += len(attempt.resume_token_ids) - len(request.resume_token_ids)
