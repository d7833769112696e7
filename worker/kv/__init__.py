"""The worker's paged KV pool: blocks and their prefix cache, page keys, the block arena, pages
read in place from a same-host kvnode, and what a sliding window releases."""
