"""Generated gRPC stubs for the kvcache wire protocol (`make protos` regenerates them)."""
