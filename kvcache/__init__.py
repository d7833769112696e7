"""kvcache: a distributed KV-cache service for LLM inference.

This package is the `kvcache` command line; the parts live in kvnode/, worker/, coordinator/,
gateway/ and protos/ (what they all share: the wire, units, the version).
"""

from protos.version import __version__

__all__ = ["__version__"]
