"""kvcache: a distributed KV-cache service for LLM inference.

This package is the `kvcache` command line; the parts live in kvnode/, worker/, coordinator/,
gateway/, protos/ (the wire) and base/ (what they all share: serving, TLS, units, the version).
"""

from base.version import __version__

__all__ = ["__version__"]
