"""The key check the node and its client share: a page key is KEY_BYTES bytes on every wire
and in every store (base/pages.py). Here, apart from the store, so that the client
(kvnode/client/) refuses a bad key as the node would without importing the node."""

from __future__ import annotations

from base.pages import KEY_BYTES


class InvalidRequest(ValueError):
    """The caller sent something malformed; nothing was changed."""


def check_key(key: bytes, what: str = "key") -> None:
    if len(key) != KEY_BYTES:
        raise InvalidRequest(f"{what} must be {KEY_BYTES} bytes, got {len(key)}")
