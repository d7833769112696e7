"""Pages a put was refused, logged as one line per reason and interval with their count.

A full node, or one restarted without the parents of the pages written to it, refuses pages of
most puts: a line per put was 1,713 lines in four minutes on one node of `kvcache bench chaos`.
The node's metrics count every refused page by outcome; the log says that it goes on, and why.
Shared by the gRPC PutPages and the data plane's PUT, which write to the one store of the process.
"""

from __future__ import annotations

import logging
from typing import Sequence

from base.log_limits import CountedEvent
from kvnode.store.types import PutOutcome

log = logging.getLogger("kvnode")

_WHY = {
    PutOutcome.REFUSED_NO_PARENT: "their parent page is not on this node (evicted, or lost in a restart)",
    PutOutcome.REFUSED_NO_ROOM: "no room (every page leased or being read, or the disk tier failed them)",
}
_EVENTS = {outcome: CountedEvent() for outcome in _WHY}


def log_refused(outcomes: Sequence[PutOutcome]) -> None:
    """Count a put's refused pages; log those of a reason whose line is due."""
    for outcome, event in _EVENTS.items():
        refused = sum(1 for o in outcomes if o == outcome)
        if refused:
            event.happened(refused)
            count = event.to_log()
            if count:
                log.info("put refused %d page(s) since the last such line: %s", count, _WHY[outcome])
