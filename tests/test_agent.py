"""The agent's choice of share session for a (batch, slot): no member of the group left unpolled."""
from __future__ import annotations

import threading

from spark_share.agent import Agent


class FakeSession:
    def __init__(self, n):
        self.session_id = f"s{n}"
        self.busy = False
        self.max_poll_records = 500


def agent_with(sessions):
    a = Agent.__new__(Agent)  # the selection logic only; no tracker, no broker
    a.agent_id = "test"
    a._lock, a._resize_lock = threading.Lock(), threading.Lock()
    a._sessions, a._reserved, a._last_taken = list(sessions), set(), {}
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
