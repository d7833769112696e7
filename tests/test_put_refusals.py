"""Pages a put was refused are logged as one line per reason and interval with their count
(kvnode/store/put_refusals.py): a full or restarted node refuses pages of most puts, and a line per
put filled its log."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from base.log_limits import CountedEvent
from kvnode.store import put_refusals
from kvnode.store.types import PutOutcome
from store_helpers import key

NO_PARENT, NO_ROOM = PutOutcome.REFUSED_NO_PARENT, PutOutcome.REFUSED_NO_ROOM


@pytest.fixture
def log_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(put_refusals, "_EVENTS", {o: CountedEvent(clock=lambda: now[0]) for o in put_refusals._WHY})
    return now


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("put refused")]


def test_one_line_per_reason_and_interval_with_the_pages_it_stands_for(log_clock, caplog):
    with caplog.at_level(logging.INFO, logger="kvnode"):
        put_refusals.log_refused([NO_PARENT, PutOutcome.STORED, NO_PARENT])
        assert lines(caplog) == ["put refused 2 page(s) since the last such line: their parent page is not on "
                                 "this node (evicted, or lost in a restart)"]
        put_refusals.log_refused([NO_PARENT] * 5 + [NO_ROOM])  # no parent: within its interval
        assert len(lines(caplog)) == 2 and lines(caplog)[1].startswith("put refused 1 page(s) since the last such "
                                                                       "line: no room")
        put_refusals.log_refused([PutOutcome.STORED, PutOutcome.ALREADY_PRESENT])
        log_clock[0] += 11.0
        put_refusals.log_refused([NO_PARENT])
        assert len(lines(caplog)) == 3 and lines(caplog)[2].startswith("put refused 6 page(s)")


def test_orphan_pages_put_again_and_again_make_one_line(node, log_clock, caplog):
    orphans = [key(100 + i) for i in range(3)]
    data = np.zeros((3, node.store.page_bytes), np.uint8)
    with caplog.at_level(logging.INFO, logger="kvnode"), node.client(use_data_plane=False) as client:
        for _ in range(10):
            assert client.put_pages(orphans, [key(99)] * 3, data).stored == 0
    assert len(lines(caplog)) == 1 and lines(caplog)[0].startswith("put refused 3 page(s)")
