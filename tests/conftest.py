"""Shared fixtures: an in-process node (store open to inspection, hand-driven clock) and a
real `kvcache node` process. The helpers behind them live in cluster_helpers.py."""

from __future__ import annotations

import contextlib

import pytest

from cluster_helpers import NODE_CAPACITY_PAGES, NODE_PAGE_BYTES, node_process, serve_node
from kvnode.store import PageStore
from store_helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_node(clock):
    """make_node(capacity_pages=..., page_bytes=..., max_keys=..., max_message_bytes=...) -> InProcessNode."""
    with contextlib.ExitStack() as stack:

        def make(capacity_pages=NODE_CAPACITY_PAGES, page_bytes=NODE_PAGE_BYTES, **kwargs):
            store = PageStore(capacity_pages, page_bytes, clock=clock)
            return stack.enter_context(serve_node(store, **kwargs))

        yield make


@pytest.fixture
def node(make_node):
    return make_node()


@pytest.fixture
def client(node):
    with node.client() as c:
        yield c


@pytest.fixture
def node_proc(tmp_path):
    """A real `kvcache node` process on a free port with small pages."""
    with node_process(tmp_path, "--capacity", "64KiB", "--page-bytes", str(NODE_PAGE_BYTES)) as daemon:
        yield daemon
