"""The pools of a `kvcache cluster up` of NumPy workers, sized to its model unless given
(base/pool_sizes.py): each worker holds one sequence of the model's full context, and each kvnode
can lease a whole prompt that long. One line says them before anything starts.

smollm2-135m in float32 (the defaults): pages of 720 KiB (16 tokens of 30 layers x K and V x 3
heads x 64 dims x 4 bytes), 8,192 positions = 512 pages: 360 MiB a worker, and 720 MiB a kvnode,
which leases at most half its pool at once (--max-leased-fraction). The default cluster's pools
come to 2 x 360 MiB + 3 x 720 MiB, 2.8 GiB; each worker holds its model's weights besides
(~1.1 GiB resident for smollm2-135m, dequantized to float32).
"""

from __future__ import annotations

from dataclasses import dataclass

from base.pages import DEFAULT_PAGE_TOKENS
from base.pool_sizes import PoolSize, describe, leased_pages, node_pool, worker_pool
from base.units import parse_size
from kvcache.model_pages import model_max_positions, model_page_bytes
from kvnode.daemon import DEFAULT_MAX_LEASED_FRACTION


@dataclass(frozen=True)
class ClusterSizes:
    model: str
    kv_dtype: str
    max_positions: int
    worker: PoolSize
    node: PoolSize
    workers: int
    nodes: int

    def line(self) -> str:
        """The one line `cluster up` says before it starts anything."""
        page_tokens = DEFAULT_PAGE_TOKENS
        full = self.max_positions
        worker_tokens = self.worker.pages * page_tokens
        worker_says = (f"one full {full}-token context" if worker_tokens >= full
                       else f"prompts up to {worker_tokens} of the model's {full} tokens")
        leased = leased_pages(self.node.pages, DEFAULT_MAX_LEASED_FRACTION)
        node_says = (f"a whole {full}-token prompt" if leased * page_tokens >= full
                     else f"{leased * page_tokens} tokens of a prompt, of the model's {full}")
        total = self.workers * self.worker.bytes + self.nodes * self.node.bytes
        flags = "--worker-kv-cache, --node-capacity" + ("; --kv-dtype float16 halves them"
                                                        if self.kv_dtype == "float32" else "")
        return (f"pools for {self.model} ({self.kv_dtype} KV, {describe(self.worker.page_bytes // page_tokens)} a "
                f"token): each worker {describe(self.worker.bytes)}, {self.worker.pages} blocks of {page_tokens} "
                f"tokens, {worker_says}; each kvnode {describe(self.node.bytes)}, {self.node.pages} pages, {leased} "
                f"leasable at once, {node_says}; {describe(total)} in all ({flags})")

def settle(model: str, kv_dtype: str, worker_kv_cache: str | None, node_capacity: str | None,
           workers: int, nodes: int) -> ClusterSizes:
    """The pools' sizes: those given, else sized to the model. ValueError for a size that cannot be read."""
    page_bytes = model_page_bytes(model, kv_dtype)
    max_positions = model_max_positions(model)
    worker = (PoolSize(max(1, parse_size(worker_kv_cache) // page_bytes), page_bytes) if worker_kv_cache
              else worker_pool(page_bytes, max_positions, DEFAULT_PAGE_TOKENS))
    node = (PoolSize(parse_size(node_capacity) // page_bytes, page_bytes) if node_capacity
            else node_pool(page_bytes, max_positions, DEFAULT_PAGE_TOKENS, DEFAULT_MAX_LEASED_FRACTION))
    if node.pages < 1:
        raise ValueError(f"--node-capacity {node_capacity} holds no page of {model} ({page_bytes} bytes in "
                         f"{kv_dtype}): give at least {page_bytes} bytes")
    return ClusterSizes(model, kv_dtype, max_positions, worker, node, workers, nodes)

