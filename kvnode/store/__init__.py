"""The page store: pool, index, pins, drops, leases, the RAM and disk tiers, the flusher."""
