"""coordinator: membership, the consistent-hash ring, routing and placement."""
