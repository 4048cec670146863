"""A share session's polls: an empty one ends when a fetch comes back empty, not at its timeout."""
from __future__ import annotations

import time

from spark_share.session import ShareSession


def test_polls_end_when_a_fetch_comes_back_empty_and_not_while_one_is_on_its_way(kafka, produce):
    """A poll on an empty queue returns once a fetch sent after it began came back empty (the first
    one also waits for the group join), long before its timeout; a poll on a queue with records
    returns them rather than giving up."""
    from spark_share.pool import FIRST_POLL_MIN_MS

    kafka.create_topic("empty", 1)
    kafka.create_topic("full", 1)
    produce(kafka, "full", 5)
    conf = {"bootstrap.servers": kafka.bootstrap_servers, "share.acknowledgement.mode": "explicit"}
    empty = ShareSession("t-e", dict(conf, **{"group.id": "e"}), ["empty"], False)
    full = ShareSession("t-f", dict(conf, **{"group.id": "f"}), ["full"], False)
    try:
        for attempt in ("first", "later"):
            t0 = time.monotonic()
            rb, _ = empty.poll(0, 0, None, 60_000).result(timeout=90)
            took = time.monotonic() - t0
            assert rb.num_rows == 0 and not empty.busy
            assert took < FIRST_POLL_MIN_MS / 1000.0, f"the {attempt} empty poll waited {took:.1f} s"
        rb, _ = full.poll(0, 0, None, 60_000).result(timeout=90)
        assert rb.num_rows == 5
        # A session that found its queue empty still gets what arrives later.
        produce(kafka, "empty", 3)
        rb, _ = empty.poll(1, 0, None, 60_000).result(timeout=90)
        assert rb.num_rows == 3
    finally:
        empty.close().result(timeout=30)
        full.close().result(timeout=30)
