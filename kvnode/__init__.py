"""kvnode: a KV-store node (page pool, index, prefix-aware LRU eviction, leases) and its client.

Other parts use only `kvnode.client` (kvnode/client/). The client and the node share wire/, which
imports nothing of the node's server; everything else here is the node's own.
"""
