"""Pages travel with their checksums on both wires (data plane and gRPC), and NodeClient refuses a
page whose bytes were altered on the node: PageRejected names it, the pages before it arrive
intact, and DropPages removes it with its descendants."""

from __future__ import annotations

import numpy as np
import pytest

from data_plane_helpers import GOOD, GOOD_PARENTS, pages
from kvnode.wire.checksum import page_checksum
from kvnode.client import PageRejected

PATHS = pytest.mark.parametrize("use_data_plane", [True, False], ids=["data plane", "gRPC"])


def flip_byte_in_pool(node, key: bytes, offset: int = 100) -> None:
    """Alter a stored page in the node's RAM, as a bad memory module or a bug would."""
    node.store._pool[node.store._index[key].slot, offset] ^= 0x01


@PATHS
def test_pages_put_through_the_client_keep_the_writers_checksums(node, plane, use_data_plane):
    with node.client(use_data_plane=use_data_plane) as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, pages(3)).stored == 3
        np.testing.assert_array_equal(client.get_pages(GOOD), pages(3))
    assert node.store.checksums(GOOD) == [page_checksum(k, row) for k, row in zip(GOOD, pages(3))]


@PATHS
def test_a_page_altered_on_the_node_is_rejected_and_those_before_it_arrive_intact(seeded, use_data_plane):
    flip_byte_in_pool(seeded, GOOD[1])
    out = np.zeros((3, pages(3).shape[1]), dtype=np.uint8)
    with seeded.client(use_data_plane=use_data_plane) as client:
        with pytest.raises(PageRejected) as rejected:
            client.get_pages(GOOD, out=out)
    assert (rejected.value.index, rejected.value.key) == (1, GOOD[1])
    assert "does not match its checksum" in str(rejected.value)
    np.testing.assert_array_equal(out[0], pages(3)[0])


@PATHS
def test_a_page_put_with_a_checksum_its_bytes_do_not_match_is_refused_by_its_first_reader(node, plane,
                                                                                          use_data_plane):
    data = pages(3)
    sums = [page_checksum(k, row) for k, row in zip(GOOD, data)]
    data[2, 0] ^= 0xFF  # altered in the writer after its checksum was taken
    with node.client(use_data_plane=use_data_plane) as client:
        assert client.put_pages(GOOD, GOOD_PARENTS, data, checksums=sums).stored == 3
        with pytest.raises(PageRejected) as rejected:
            client.get_pages(GOOD)
    assert rejected.value.index == 2


def test_drop_pages_takes_an_altered_page_and_its_descendants_only(seeded):
    with seeded.client() as client:
        assert client.drop_pages([GOOD[1]]) == 0  # intact on the node: a report cannot drop it
        assert client.lookup(GOOD) == 3
        flip_byte_in_pool(seeded, GOOD[1])
        assert client.drop_pages([GOOD[1]]) == 2
        assert client.lookup(GOOD) == 1
        assert client.drop_pages([GOOD[1]]) == 0
        assert client.stats()["reported_pages_dropped"] == 2
    seeded.store.check_invariants()
