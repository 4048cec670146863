"""How the agent's session pool chooses: every share session once per batch, busy ones skipped; a new
one only when the tracker grants it; idle ones closed when the tracker says the query needs them no more."""
from __future__ import annotations

from spark_share.consumers.pool import SessionPool


class FakeSession:
    def __init__(self, n):
        self.session_id = f"s{n}"
        self.busy = False
        self.carrying = 0
        self.max_poll_records = 500
        self.replay = False
        self.created_at = 0.0
        self.closed = False
        self.holding = None
        self.waited_for: list = []  # the closings this one's close waited for

    def close(self, after=()):
        from concurrent.futures import Future

        self.closed = True
        self.waited_for = list(after)
        f = Future()
        f.set_result(None)
        return f

    def joined(self, timeout_s):
        from concurrent.futures import Future

        f = Future()
        f.set_result(True)
        return f


def pool_of(sessions):
    pool = SessionPool(new_session=lambda max_poll_records, replay=False: FakeSession(len(pool.sessions)), name="test")
    pool.sessions = list(sessions)
    return pool


def test_every_session_is_polled_once_per_batch_before_any_is_reused():
    sessions = [FakeSession(i) for i in range(4)]
    a = pool_of(sessions)
    for batch in range(3):
        # Two task slots at a time, as local[2]; empty polls hand their session back at once.
        seen = []
        for slot in range(4):
            s, _ = a.reserve(batch, None)
            seen.append(s.session_id)
            a.give_back(s)
        assert sorted(seen) == ["s0", "s1", "s2", "s3"], f"batch {batch} polled {seen}"


def test_busy_and_reserved_sessions_are_skipped():
    sessions = [FakeSession(i) for i in range(3)]
    a = pool_of(sessions)
    sessions[0].busy = True
    first, _ = a.reserve(0, None)
    second, _ = a.reserve(0, None)
    assert {first.session_id, second.session_id} == {"s1", "s2"}
    assert a.reserve(0, None) == (None, None), "none free: a new one is the tracker's to grant"
    third = a.open(0, None)
    assert third.session_id == "s3" and len(a) == 4
    a.give_back(first)
    # Only a session already used in this batch is free: it is reused rather than a new one started.
    assert a.reserve(0, None)[0] is first


class SizedSession(FakeSession):
    def __init__(self, n, size):
        super().__init__(n)
        self.max_poll_records = size
        self.closed = False



def sized_pool(monkeypatch, full=1000):
    made = []

    def new(max_poll_records, replay=False):
        made.append(SizedSession(len(made), max_poll_records or full))
        made[-1].replay = replay
        return made[-1]

    pool = SessionPool(new_session=new, name="test")
    pool.start(2)
    return pool, made


def test_sessions_shrink_with_the_budget_and_grow_back_only_when_none_holds_records(monkeypatch):
    pool, made = sized_pool(monkeypatch)
    assert pool.full_size == 1000
    s, _ = pool.reserve(0, 200)  # lowered after lock expiry: every free session is replaced at once
    assert s.max_poll_records == 200 and [m.closed for m in made[:2]] == [True, True]
    assert {x.max_poll_records for x in pool.sessions} == {200}
    s.busy = True  # holds batch 0's records
    pool.give_back(s)
    other, _ = pool.reserve(1, 400)
    assert other.max_poll_records == 200, "no growing while a session holds records"
    pool.give_back(other)
    s.busy = False
    grown, _ = pool.reserve(2, 400)
    assert grown.max_poll_records == 400 and {x.max_poll_records for x in pool.sessions} == {400}
    pool.give_back(grown)
    full, _ = pool.reserve(3, None)
    assert full.max_poll_records == 1000, "back to the configured size"


def test_a_replay_gets_sessions_of_its_own_which_the_next_batch_replaces_once_they_carry_nothing(monkeypatch):
    pool, made = sized_pool(monkeypatch)
    pool.fit(0, 1000)  # as big as the run's polls: still replaced, its fetches must wait for every partition
    assert [m.closed for m in made[:2]] == [True, True]
    assert [(x.replay, x.max_poll_records) for x in pool.sessions] == [(True, 1000)] * 2
    pool.fit(0, 1000)
    s, _ = pool.reserve(0, None)  # the replay's own read
    assert len(made) == 4 and s.replay, "sessions made for the replay stay while it reads"
    pool.give_back(s)
    pool.sessions[0].carrying = 300  # acquired beyond the replayed batch: the next batch's
    s, _ = pool.reserve(1, None)
    assert s.replay and s.carrying and len(made) == 4, "none is replaced while one carries records"
    s.carrying = 0
    pool.give_back(s)
    s, _ = pool.reserve(2, None)
    assert not s.replay and not any(x.replay for x in pool.sessions) and len(pool.sessions) == 2


def test_after_a_replay_its_sessions_hand_out_what_they_carry_before_any_session_joins_leaves_or_fetches(monkeypatch):
    """What a replay's polls (the lock budget) acquired beyond its batch goes to the next batches, not back to
    the broker (a delivery each). Meanwhile nothing joins or leaves (on the embedded broker that ends the
    share session of one holding records: the failure CI runs caught when a capped batch shrank the other
    session) and the replay's other session does not fetch (its polls are the lock budget)."""
    pool, made = sized_pool(monkeypatch)
    pool.fit(0, 1000)
    carrier, other = pool.sessions
    carrier.carrying = 300  # acquired beyond the replayed batch
    s, _ = pool.reserve(1, 50)  # the next batch, under a cap
    assert s is carrier and len(made) == 4 and not any(m.closed for m in made[2:4]), "nothing replaced while one carries"
    assert pool.reserve(1, 50) == (None, None), "the replay's other session fetches nothing"
    assert not pool.may_join(1) and pool.may_join(0)
    assert pool.trim(not_since_batch=5, idle_s=0) == 0 and not other.closed, "nor does one leave"
    assert pool.prefetch(1, 2, 50, 100) == 0  # none free: the carrier is reserved, the other may not fetch
    carrier.carrying, carrier.busy = 0, True  # handed out, and held by batch 1 (the CI case: it held them)
    pool.give_back(carrier)
    assert pool.reserve(1, 50) == (None, None) and not pool.may_join(1) and len(made) == 4, (
        "nothing joins while a replay session holds what it handed out")
    carrier.busy = False  # batch 1 acknowledged
    s, _ = pool.reserve(2, 50)  # every replay session replaced at once
    assert not s.replay and [m.closed for m in made[2:4]] == [True, True] and len(pool.sessions) == 2
    assert pool.may_join(2)


def test_a_prefetch_that_comes_while_the_sessions_join_polls_once_they_have():
    """The tracker plans the first batch while the agent's sessions are still joining: its polls
    start when they have joined, and the first reads take them."""
    import time
    from concurrent.futures import Future

    polled = []

    class PollingSession(FakeSession):
        polls = 0

        def __init__(self, n):
            super().__init__(n)
            self.created_at = time.monotonic()

        def poll(self, batch, slot, max_records, timeout_ms, carry_ms=None):
            polled.append((self.session_id, batch))
            f = Future()
            f.set_result(None)
            return f

    made = []
    pool = SessionPool(new_session=lambda _size, _replay=False: made.append(PollingSession(len(made))) or made[-1], name="test")
    assert pool.prefetch(0, 2, None, 1000) == 0
    assert polled == []
    pool.start(2)
    assert sorted(polled) == [("s0", 0), ("s1", 0)]
    assert all(pool.reserve(0, None)[1] is not None for _ in range(2)), "a read did not get the poll started ahead"


def test_trim_closes_only_free_sessions_not_polled_since_a_batch_nor_for_a_while(monkeypatch):
    """The tracker caps the query's members: it asks an agent to close the consumers no read used lately
    (one, to move it to another host; or all idle ones, a host Spark stopped reading on). Never one a read
    holds, one whose records await an acknowledgement, or one carrying records (closing releases them,
    and each release spends a delivery)."""
    from spark_share.consumers import pool as pool_module

    clock = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    sessions = [FakeSession(i) for i in range(5)]
    a = pool_of(sessions)
    for batch, s in ((3, sessions[0]), (5, sessions[1]), (5, sessions[2])):
        a._last_taken[s.session_id] = (batch, clock[0])
    sessions[3].busy = True  # never polled, but holds records
    held, _ = a.reserve(6, None)  # s4, never polled: a read takes it
    assert held is sessions[4]
    sessions[2].carrying = 40
    clock[0] += 30
    assert a.trim(not_since_batch=5, idle_s=60) == 0, "none idle for 60 s"
    assert a.trim(not_since_batch=5, idle_s=15) == 1 and sessions[0].closed
    assert [s.session_id for s in a.sessions] == ["s1", "s2", "s3", "s4"]
    assert a.trim(not_since_batch=7, idle_s=0, at_most=1) == 1 and sessions[1].closed, "s2 carries, s3 is busy, s4 is read"
    assert a.trim(not_since_batch=7, idle_s=0) == 0


def test_a_refused_session_is_closed_and_forgotten():
    sessions = [FakeSession(i) for i in range(2)]
    a = pool_of(sessions)
    s, _ = a.reserve(0, None)
    a.drop(s)
    assert s.closed and s not in a.sessions and len(a) == 1


def test_sessions_that_join_after_close_all_leave_at_once():
    """The agent's shutdown (a stop as the query starts) can come while its first sessions join: they close
    instead of joining the pool, and so does one a read opens after it."""
    import threading

    import pytest

    from spark_share.errors import AgentError

    made: list[FakeSession] = []
    joining, shut = threading.Event(), threading.Event()

    class SlowJoin(FakeSession):
        def joined(self, timeout_s):
            joining.set()
            shut.wait(10)  # the shutdown comes meanwhile
            return super().joined(timeout_s)

    pool = SessionPool(new_session=lambda _size, _replay=False: made.append(SlowJoin(len(made))) or made[-1], name="test")
    starting = threading.Thread(target=pool.start, args=(2,))
    starting.start()
    assert joining.wait(10)
    assert pool.close_all() == []  # nothing had joined yet
    shut.set()
    starting.join(10)
    assert not starting.is_alive() and len(made) == 2 and all(s.closed for s in made) and len(pool) == 0
    with pytest.raises(AgentError, match="shutting down"):
        pool.open(0, None)
    assert len(made) == 3 and made[-1].closed and len(pool) == 0


def test_sessions_holding_nothing_close_before_the_ones_that_release_records():
    """After an empty poll the client fetches on its own: a session holding nothing, still open while a
    sibling's close releases its records, would acquire them and drop them as it closes in turn (a delivery
    spent, unseen). So the ones holding nothing close first, and those holding or carrying records close
    once those closings are done."""
    sessions = [FakeSession(i) for i in range(4)]
    sessions[1].holding = object()
    sessions[3].carrying = 20
    pool = pool_of(sessions)
    closing = pool.close_all()
    assert len(closing) == 4 and all(s.closed for s in sessions)
    first = closing[:2]
    assert sessions[0].waited_for == sessions[2].waited_for == []
    assert sessions[1].waited_for == sessions[3].waited_for == first


def test_a_replay_waits_until_its_sessions_are_given_every_partition_it_names():
    """A replay polls each session once, and a session whose poll brought records polls again only after their
    acknowledgement: it first waits until the sessions' assignments cover the batch's partitions (on Kafka
    the broker moves the partitions of members that left a heartbeat later)."""
    import threading
    import time

    sessions = [FakeSession(i) for i in range(2)]
    given = {"s0": {("t", 1)}, "s1": {("t", 1)}}
    for s in sessions:
        s.assigned = lambda s=s: frozenset(given[s.session_id])
    pool = pool_of(sessions)
    assert not pool.await_assignment({("t", 0), ("t", 1)}, timeout_s=0.3), "partition 0 is nobody's"
    moved = threading.Timer(0.2, lambda: given["s1"].add(("t", 0)))
    moved.start()
    try:
        assert pool.await_assignment({("t", 0), ("t", 1)}, timeout_s=10)
    finally:
        moved.cancel()
    assert pool.await_assignment({("t", 1)}, timeout_s=0)
    given["s1"].clear()
    stopping = threading.Timer(0.2, pool.close_all)
    stopping.start()
    try:
        started = time.monotonic()
        assert not pool.await_assignment({("t", 0)}, timeout_s=30)
        assert time.monotonic() - started < 10, "close_all ends the wait, not its timeout"
    finally:
        stopping.cancel()
