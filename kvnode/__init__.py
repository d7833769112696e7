"""kvnode: a KV-store node (page pool, index, prefix-aware LRU eviction, leases) and its client.

Other parts use only `kvnode.client`; everything else here is the node's own.
"""
