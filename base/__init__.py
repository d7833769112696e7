"""What every part of kvcache shares, below them all: serving gRPC, TLS and tokens, metrics and
tracing, addresses, a member's registration with the coordinators, Generate's events, page facts,
units, the version. It imports none of the parts, so any part may import it; protos/ beside it
keeps the wire contract alone."""
