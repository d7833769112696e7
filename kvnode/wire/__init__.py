"""What both ends of a kvnode's wires share: key and checksum rules, the data plane's and the
gRPC bulk messages' framing, TLS over a socket, the shared pool's layout. Nothing of the server."""
