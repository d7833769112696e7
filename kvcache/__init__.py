"""kvcache: a distributed KV-cache service for LLM inference.

This package holds what every part shares (version, units) and the `kvcache`
command line; the parts live in kvnode/, worker/, coordinator/ and protos/.
"""

__version__ = "0.1.0"
