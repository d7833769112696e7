"""Shared fixtures: an in-process node (store open to inspection, hand-driven clock), a data
plane on it, and a real `kvcache node` process. The helpers behind them live in
cluster_helpers.py and data_plane_helpers.py."""

from __future__ import annotations

import contextlib
import logging

import pytest

from cluster_helpers import NODE_CAPACITY_PAGES, NODE_PAGE_BYTES, node_process, serve_node
from data_plane_helpers import GOOD, GOOD_PARENTS, MAX_KEYS, pages
from kvnode.data_plane.server import DataPlaneServer
from kvnode.store.page_store import PageStore
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


@pytest.fixture
def plane(node):
    """A data plane on the in-process node's store, advertised in its Info."""
    server = DataPlaneServer(node.store, "127.0.0.1", 0, max_keys=MAX_KEYS, max_connections=4, timeout_s=2.0)
    server.start()
    node.service.data_port = server.port
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def seeded(node, plane):
    with node.client(use_data_plane=False) as grpc_client:
        assert grpc_client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
    return node


@pytest.fixture
def no_kvnode_errors_logged(caplog):
    """A bad peer is refused or dropped with an info line, never an error with a traceback."""
    with caplog.at_level(logging.INFO, logger="kvnode"):
        yield
    errors = [r for r in caplog.records if r.name == "kvnode" and r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A development CA and one certificate per role (`kvcache certs`), for a module's secure daemons."""
    from kvcache.certs import make_certs  # cryptography: only for the tests that ask

    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder)
    return folder
