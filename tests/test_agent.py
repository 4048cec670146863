"""How the agent polls: every share session once per batch, and no drained one holding a batch up."""
from __future__ import annotations

import threading
import time

from spark_share.agent import Agent
from spark_share.session import ShareSession


class FakeSession:
    def __init__(self, n):
        self.session_id = f"s{n}"
        self.busy = False
        self.max_poll_records = 500


def agent_with(sessions):
    a = Agent.__new__(Agent)  # the selection logic only; no tracker, no broker
    a.agent_id = "test"
    a._lock, a._resize_lock = threading.Lock(), threading.Lock()
    a._sessions, a._reserved, a._last_taken, a._first_rows = list(sessions), set(), {}, {}
    return a


def test_every_session_is_polled_once_per_batch_before_any_is_reused():
    sessions = [FakeSession(i) for i in range(4)]
    a = agent_with(sessions)
    for batch in range(3):
        # Two task slots at a time, as local[2]; empty polls hand their session back at once.
        seen = []
        for slot in range(4):
            s = a._take_session(batch, None)
            seen.append(s.session_id)
            a._give_back(s)
        assert sorted(seen) == ["s0", "s1", "s2", "s3"], f"batch {batch} polled {seen}"


def test_busy_and_reserved_sessions_are_skipped():
    sessions = [FakeSession(i) for i in range(3)]
    a = agent_with(sessions)
    sessions[0].busy = True
    first = a._take_session(0, None)
    second = a._take_session(0, None)
    assert {first.session_id, second.session_id} == {"s1", "s2"}
    a._give_back(first)
    # Only a session already used in this batch is free: it is reused rather than a new one started.
    assert a._take_session(0, None) is first


def test_an_empty_poll_stops_waiting_once_the_batch_has_records_elsewhere():
    a = agent_with([])
    assert not a._others_done(3)  # no poll of batch 3 has brought records
    a._first_rows[3] = (time.monotonic(), 0.3)
    assert not a._others_done(3)  # it just did: linger as long as it took, at least POLL_LINGER_S
    a._first_rows[3] = (time.monotonic() - 1.0, 0.3)
    assert a._others_done(3)
    assert not a._others_done(4)


def test_a_session_poll_gives_up_when_asked(kafka):
    kafka.create_topic("quiet", 1)
    s = ShareSession("t-1", {"bootstrap.servers": kafka.bootstrap_servers, "group.id": "quiet-g",
                             "share.acknowledgement.mode": "explicit"}, ["quiet"], False)
    try:
        asked = threading.Event()

        def give_up():
            asked.set()
            return True

        rb, holding = s.poll(0, 0, None, 600_000, give_up).result(timeout=60)  # not the 10-minute timeout
        assert asked.is_set() and rb.num_rows == 0 and not s.busy
    finally:
        s.close().result(timeout=30)


def test_a_first_poll_ends_once_the_session_has_joined_and_fetched(kafka, produce):
    """A new session's first poll on an empty queue returns as soon as librdkafka reports it joined
    with partitions and fetched since, not after the FIRST_POLL_MIN_MS fallback; on a queue with
    records it returns them rather than giving up."""
    from spark_share.agent import FIRST_POLL_MIN_MS

    kafka.create_topic("empty", 1)
    kafka.create_topic("full", 1)
    produce(kafka, "full", 5)
    conf = {"bootstrap.servers": kafka.bootstrap_servers, "share.acknowledgement.mode": "explicit"}
    empty = ShareSession("t-e", dict(conf, **{"group.id": "e"}), ["empty"], False)
    full = ShareSession("t-f", dict(conf, **{"group.id": "f"}), ["full"], False)
    try:
        t0 = time.monotonic()
        rb, _ = empty.poll(0, 0, None, 60_000, lambda: empty.ready).result(timeout=90)
        took = time.monotonic() - t0
        assert rb.num_rows == 0 and empty.ready
        assert took < FIRST_POLL_MIN_MS / 1000.0, f"the first poll waited {took:.1f} s"
        rb, _ = full.poll(0, 0, None, 60_000, lambda: full.ready).result(timeout=90)
        assert rb.num_rows == 5
    finally:
        empty.close().result(timeout=30)
        full.close().result(timeout=30)
