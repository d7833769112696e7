"""NodeClient, the one way other parts reach a kvnode, and what it returns and raises.

Other parts import these names from here only. The package imports nothing of the node's server
(store, eviction, disk tier): only what both sides share, the key check (kvnode/wire/keys.py), the
checksum (kvnode/wire/checksum.py), the wire framing (kvnode/wire/grpc_frames.py, kvnode/wire/data_frames.py), TLS over
memory BIOs (kvnode/wire/tls_stream.py) and the shared pool's mapping (kvnode/wire/shared_pool.py).
"""

from kvnode.wire.checksum import page_checksum
from kvnode.client.node_client import NodeClient
from kvnode.client.shared_pool_pins import PinnedPages
from kvnode.client.shared_pool_reader import SharedPoolFile
from kvnode.client.types import NodeError, NodeInfo, PageRejected, PutResult

__all__ = ["NodeClient", "NodeError", "NodeInfo", "PageRejected", "PinnedPages", "PutResult", "SharedPoolFile",
           "page_checksum"]
