"""worker: runs the model over a paged KV cache and fetches cached pages from kvnodes."""
