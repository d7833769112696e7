"""What every part agrees on about a page: its key is KEY_BYTES bytes on every wire and in every
store (worker/kv/pages.py derives it from the page's tokens and its parent's key), and a page holds
DEFAULT_PAGE_TOKENS tokens unless a worker is started with another --page-tokens. Its bytes are K/V in
one of KV_DTYPES (int8 and int4: quantized with their scales, worker/kv/quant.py)."""

KEY_BYTES = 16
DEFAULT_PAGE_TOKENS = 16
KV_DTYPES = ("float32", "float16", "int8", "int4")
