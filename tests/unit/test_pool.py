"""How the agent's session pool chooses: every share session once per batch, busy ones skipped."""
from __future__ import annotations

from spark_share.pool import SessionPool


class FakeSession:
    def __init__(self, n):
        self.session_id = f"s{n}"
        self.busy = False
        self.max_poll_records = 500


def pool_of(sessions):
    pool = SessionPool(new_session=lambda max_poll_records: FakeSession(len(pool.sessions)), name="test")
    pool.sessions = list(sessions)
    return pool


def test_every_session_is_polled_once_per_batch_before_any_is_reused():
    sessions = [FakeSession(i) for i in range(4)]
    a = pool_of(sessions)
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
    a = pool_of(sessions)
    sessions[0].busy = True
    first, _ = a.take(0, None)
    second, _ = a.take(0, None)
    assert {first.session_id, second.session_id} == {"s1", "s2"}
    a.give_back(first)
    # Only a session already used in this batch is free: it is reused rather than a new one started.
    assert a.take(0, None)[0] is first
