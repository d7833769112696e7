"""The installed kvcache's version, one fact read from the package's metadata (pyproject.toml), so
every part can report it without importing the `kvcache` command-line package above it. Read on
first use (`installed()`, or the module's `__version__`): importing importlib.metadata costs
50-100 ms, which every daemon and command paid at start for a string few of them ever print."""

from __future__ import annotations

import functools


@functools.cache
def installed() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvcache")
    except PackageNotFoundError:   # run from a checkout that was never installed
        return "0+unknown"


def __getattr__(name: str) -> str:
    if name == "__version__":
        return installed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
