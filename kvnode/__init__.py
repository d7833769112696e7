"""kvnode: a KV-store node (page pool, index, prefix-aware LRU eviction, leases) and its client.

Other parts use only `kvnode.client` (kvnode/client/). The client and the node share keys.py,
checksum.py, wire.py, data_wire.py, tls_stream.py and shared_pool.py, which import nothing of the
node's server; everything else here is the node's own.
"""
