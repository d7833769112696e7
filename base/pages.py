"""What every part agrees on about a page: its key is KEY_BYTES bytes on every wire and in every
store (worker/kv/pages.py derives it from the page's tokens and its parent's key), and a page holds
DEFAULT_PAGE_TOKENS tokens unless a worker is started with another --page-tokens."""

KEY_BYTES = 16
DEFAULT_PAGE_TOKENS = 16
