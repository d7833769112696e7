"""kvcache: a distributed KV-cache service for LLM inference.

This package is the `kvcache` command line; the parts live in kvnode/, worker/, coordinator/,
gateway/, protos/ (the wire) and base/ (what they all share: serving, TLS, units, the version).
"""

from base import version as _version

__all__ = ["__version__"]


def __getattr__(name: str) -> str:
    if name == "__version__":  # read when asked (base/version.py)
        return _version.installed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
