"""The OpenAI-compatible HTTP gateway: `kvcache gateway` serves /v1/models, /v1/completions and
/v1/chat/completions (with server-sent events) in front of the coordinators, as a client of
theirs (coordinator.client.Client) and of nothing else. It keeps no state between requests, so
several can run behind a load balancer."""
