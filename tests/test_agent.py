"""How the agent polls: every share session once per batch, and no drained one holding a batch up."""
from __future__ import annotations

import time

from spark_share.pool import SessionPool
from spark_share.session import ShareSession


class FakeSession:
    def __init__(self, n):
        self.session_id = f"s{n}"
        self.busy = False
        self.max_poll_records = 500


def agent_with(sessions):
    pool = SessionPool(new_session=lambda max_poll_records: FakeSession(len(pool.sessions)), name="test")
    pool.sessions = list(sessions)
    return pool


def test_every_session_is_polled_once_per_batch_before_any_is_reused():
    sessions = [FakeSession(i) for i in range(4)]
    a = agent_with(sessions)
    for batch in range(3):
        # Two task slots at a time, as local[2]; empty polls hand their session back at once.
        seen = []
        for slot in range(4):
            s, _ = a.take(batch, None)
            seen.append(s.session_id)
            a.give_back(s)
        assert sorted(seen) == ["s0", "s1", "s2", "s3"], f"batch {batch} polled {seen}"


def test_busy_and_reserved_sessions_are_skipped():
    sessions = [FakeSession(i) for i in range(3)]
    a = agent_with(sessions)
    sessions[0].busy = True
    first, _ = a.take(0, None)
    second, _ = a.take(0, None)
    assert {first.session_id, second.session_id} == {"s1", "s2"}
    a.give_back(first)
    # Only a session already used in this batch is free: it is reused rather than a new one started.
    assert a.take(0, None)[0] is first


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
