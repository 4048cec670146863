"""An idle share session serves librdkafka's queue (statistics) on its own thread without polling
(issue 16): a fake ShareConsumer records which calls it gets, and from which thread."""
from __future__ import annotations

import threading
import time

import confluent_kafka
import pytest

from harness.support import wait_until
from spark_share.consumers import session as session_mod


class FakeShareConsumer:
    def __init__(self, conf):
        self.conf = conf
        self.calls: list[tuple[str, str]] = []  # (method, thread name)
        self.closed = False

    def _call(self, name):
        self.calls.append((name, threading.current_thread().name))

    def subscribe(self, topics):
        self._call("subscribe")

    def poll(self, timeout=-1):
        self._call("poll")
        return []

    def commit_async(self):
        assert not self.closed, "served after close"
        self._call("commit_async")
        # What librdkafka does inside the call: run the queued statistics callbacks.
        self.conf["stats_cb"]('{"ts": 0, "replyq": 0}')

    def close(self):
        self._call("close")
        self.closed = True

    def count(self, name):
        return sum(1 for n, _ in self.calls if n == name)


@pytest.fixture
def fake_consumer(monkeypatch):
    made: list[FakeShareConsumer] = []

    def factory(conf):
        made.append(FakeShareConsumer(conf))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    return made


def test_an_idle_session_serves_the_queue_on_its_thread_without_polling(fake_consumer):
    s = session_mod.ShareSession("idle", {"group.id": "g"}, ["t"], False, idle_serve_s=0.05)
    try:
        c = fake_consumer[0]
        assert c.conf["statistics.interval.ms"] == session_mod.STATS_INTERVAL_MS and c.conf["stats_cb"]
        wait_until(lambda: c.count("commit_async") >= 3, timeout=10, message="the idle session never served its queue")
        assert c.count("poll") == 0, "an idle session must not poll: a poll hands out records no batch asked for"
        assert {t for n, t in c.calls if n == "commit_async"} == {"share-session-idle"}
        assert s.idle_serves >= 3
    finally:
        s.close().result(timeout=10)
    served = c.count("commit_async")
    s._thread.join(timeout=10)
    assert not s._thread.is_alive() and c.calls[-1][0] == "close"
    assert c.count("commit_async") == served


def test_a_failing_serve_does_not_end_the_session_thread(fake_consumer, monkeypatch):
    monkeypatch.setattr(FakeShareConsumer, "commit_async", lambda self: (self._call("commit_async"), 1 / 0))
    s = session_mod.ShareSession("failing", {"group.id": "g"}, ["t"], False, idle_serve_s=0.05,
                                  join_wait_s=0)  # a fake consumer never joins a group
    try:
        c = fake_consumer[0]
        wait_until(lambda: c.count("commit_async") >= 2, timeout=10, message="the idle session never served its queue")
        rb, _ = s.poll(0, 0, None, 0).result(timeout=10)
        assert rb.num_rows == 0 and c.count("poll") >= 1
    finally:
        s.close().result(timeout=10)


def test_a_poll_of_a_consumer_that_never_joined_waits_past_its_timeout_for_the_join(fake_consumer):
    """A real broker hands a new member its partitions one heartbeat after the join (5 s by default);
    until librdkafka reports the consumer steady, its poll goes on past its own timeout (up to
    join_wait_s after the consumer was created), so a first batch does not end empty for that alone."""
    import time

    s = session_mod.ShareSession("joining", {"group.id": "g"}, ["t"], False, join_wait_s=0.6)
    try:
        t0 = time.monotonic()
        rb, held = s.poll(0, 0, None, 0).result(timeout=10)
        took = time.monotonic() - t0
        assert rb.num_rows == 0 and held.timed_out
        assert 0.4 <= took < 5, f"the never-joined consumer's poll took {took:.2f} s, its join wait 0.6 s"
    finally:
        s.close().result(timeout=10)


def test_a_joining_consumer_stops_waiting_once_another_consumer_of_the_agent_holds_records(fake_consumer):
    """The records another consumer holds wait for this batch to end, and their lock runs meanwhile: a
    consumer still joining then gives up at its own timeout (its partitions come in a later batch)."""
    import time

    s = session_mod.ShareSession("joining-late", {"group.id": "g"}, ["t"], False, join_wait_s=30,
                                 held_elsewhere=lambda session: 10.0)  # held for 10 s: past the grace
    try:
        t0 = time.monotonic()
        rb, held = s.poll(0, 0, None, 200).result(timeout=10)
        assert rb.num_rows == 0 and held.timed_out and time.monotonic() - t0 < 5
    finally:
        s.close().result(timeout=10)


def test_a_partition_assigned_during_a_poll_is_not_answered_by_fetches_sent_for_the_old_assignment():
    """A member left mid-drain and its partitions came to this consumer while a poll waited: the fetches
    counted since the poll began may have gone out for the old assignment only, so the empty answer says
    nothing of the new partitions (a drain took it as "nothing there" and ended with them unread)."""
    import json
    import time

    from spark_share.consumers.session_stats import FetchStats

    def stats(sent: int, partitions: list[int]) -> str:
        return json.dumps({"ts": int(time.monotonic() * 1e6), "cgrp": {"join_state": "steady", "assignment_size": 1},
                           "brokers": {"b1": {"nodeid": 1, "req": {"ShareFetch": sent}}},
                           "topics": {"t": {"partitions": {str(p): {"leader": 1, "desired": True}
                                                           for p in partitions}}}})

    f = FetchStats()
    started = time.monotonic() - 1.0
    base: dict[str, int] = {}
    assigned: set = set()
    f.on_stats(stats(10, [2, 3]))
    assert f.drained(started, base, assigned) is None  # the counts the poll began with
    f.on_stats(stats(12, [0, 1, 2, 3]))  # partitions 0 and 1 assigned meanwhile
    assert f.drained(started, base, assigned) == frozenset({("t", 2), ("t", 3)})
    assert f.drained(started, dict(base)) == frozenset({("t", p) for p in range(4)}), "without it: the old answer"


def test_a_consumer_given_no_partitions_yet_subscribes_again_so_that_its_next_heartbeat_goes_at_once(fake_consumer):
    """A new share group's first members get their partitions at their second heartbeat, one heartbeat
    interval (5 s by default) after they join; a subscribe() to the same topics sends that heartbeat at once.
    A consumer never reported with partitions does so at each of JOIN_NUDGES_S, on its own thread."""
    s = session_mod.ShareSession("nudged", {"group.id": "g"}, ["t"], False, join_wait_s=2.0)
    try:
        rb, held = s.poll(0, 0, None, 0).result(timeout=10)  # goes on until the consumer is join_wait_s old
        c = fake_consumer[0]
        again = [t for n, t in c.calls[1:] if n == "subscribe"]
        assert c.calls[0][0] == "subscribe" and rb.num_rows == 0
        assert len(again) == sum(1 for age in session_mod.JOIN_NUDGES_S if age < 2.0) == 4, c.calls
        assert set(again) == {"share-session-nudged"}
    finally:
        s.close().result(timeout=10)


def test_a_consumer_with_partitions_does_not_subscribe_again(fake_consumer, monkeypatch):
    """A member of a group whose partitions are set up gets them with its first heartbeat: once librdkafka's
    statistics report it a steady member with partitions, it sends no extra heartbeat."""
    import json
    import time

    def poll(self, timeout=-1):  # librdkafka serves its statistics inside poll()
        self._call("poll")
        self.conf["stats_cb"](json.dumps({
            "ts": int(time.monotonic() * 1e6), "cgrp": {"join_state": "steady", "assignment_size": 1},
            "brokers": {"b1": {"nodeid": 1, "req": {"ShareFetch": 1}}},
            "topics": {"t": {"partitions": {"0": {"leader": 1, "desired": True}}}}}))
        time.sleep(0.01)
        return []
    monkeypatch.setattr(FakeShareConsumer, "poll", poll)
    s = session_mod.ShareSession("assigned", {"group.id": "g"}, ["t"], False, join_wait_s=2.0)
    try:
        wait_until(lambda: time.monotonic() - s.created_at > 0.5, timeout=10)
        s.poll(0, 0, None, 600).result(timeout=10)  # past the first nudges' ages
        c = fake_consumer[0]
        assert c.count("poll") >= 2 and c.count("subscribe") == 1, c.calls
    finally:
        s.close().result(timeout=10)


def test_a_consumer_without_partitions_sends_no_extra_heartbeat_while_another_consumer_holds_records(fake_consumer):
    """Each extra heartbeat moves the consumer's next regular one, at which it learns that members holding the
    partitions left; a batch whose records another consumer holds may be waiting for that."""
    s = session_mod.ShareSession("waiting", {"group.id": "g"}, ["t"], False, join_wait_s=1.0,
                                 held_elsewhere=lambda session: 0.5)
    try:
        s.poll(0, 0, None, 0).result(timeout=10)
        assert fake_consumer[0].count("subscribe") == 1, fake_consumer[0].calls
    finally:
        s.close().result(timeout=10)


def test_no_extra_heartbeat_is_sent_late_once_the_records_held_elsewhere_are_acknowledged(fake_consumer):
    """The nudges skipped while another consumer held records are not sent after JOIN_NUDGES_S's last age."""
    held = {"s": 1.0}
    s = session_mod.ShareSession("late", {"group.id": "g"}, ["t"], False, join_wait_s=session_mod.JOIN_NUDGES_S[-1] + 2.0,
                                 held_elsewhere=lambda session: held["s"])
    try:
        wait_until(lambda: time.monotonic() - s.created_at > session_mod.JOIN_NUDGES_S[-1] + 1.2, timeout=20)
        held["s"] = 0.0  # the other consumer's batch was acknowledged
        s.poll(0, 0, None, 0).result(timeout=20)
        assert fake_consumer[0].count("subscribe") == 1, fake_consumer[0].calls
    finally:
        s.close().result(timeout=10)
