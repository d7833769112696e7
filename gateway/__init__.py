"""The OpenAI-compatible HTTP gateway: `kvcache gateway` serves /v1/models, /v1/completions and
/v1/chat/completions (with server-sent events) in front of the coordinators, as a client of
theirs (coordinator.client.Client) and of nothing else, and vLLM's /tokenize, /detokenize and
/tokenizer_info from the models' tokenizers, which it loads itself (tokenizers.py). It keeps no
state between requests, so several can run behind a load balancer."""
