"""A vLLM KV connector that keeps vLLM's KV blocks in a kvcache cluster (docs/vllm.md).

vLLM loads it by name: kv_connector "KVCacheConnector", kv_connector_module_path
"vllm_connector.connector". Only connector.py imports vLLM; the rest is plain Python over
the kvnode client, so it is tested without vLLM installed.
"""
