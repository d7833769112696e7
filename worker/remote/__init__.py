"""The remote tier: kvnodes as a KV tier behind the connector (known nodes, fetches, write-back)."""
