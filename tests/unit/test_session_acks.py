"""A session acknowledges every record it holds exactly once, with the verdict asked for, and counts
the ones the client refuses (no longer in flight) without stopping at them: a fake ShareConsumer
records each acknowledge_offset call and refuses the offsets a test names."""
from __future__ import annotations

import json
import time

import confluent_kafka
import pytest

from harness.support import wait_until
from spark_share.acknowledgement import ACCEPT, REJECT, RELEASE
from spark_share.consumers import session as session_mod
from spark_share.verdict_set import VerdictSet


class NotInFlight(Exception):
    pass


class FakeShareConsumer:
    def __init__(self, conf, refuse: set):
        self.refuse = refuse  # the test's set: it may add to it after the session started
        self.acked: list[tuple[str, int, int, int]] = []
        self.commits = 0

    def subscribe(self, topics):
        pass

    def acknowledge_offset(self, topic, partition, offset, kind):
        if (topic, partition, offset) in self.refuse:
            raise NotInFlight(f"{topic}-{partition}@{offset} is not in flight")
        self.acked.append((topic, partition, offset, kind))

    def commit_sync(self, timeout):
        self.commits += 1
        return {}

    def commit_async(self):
        pass

    def close(self):
        pass


@pytest.fixture
def session(monkeypatch):
    made: list[FakeShareConsumer] = []
    refuse: set = set()

    def factory(conf):
        made.append(FakeShareConsumer(conf, refuse))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    s = session_mod.ShareSession("acks", {"group.id": "g"}, ["t"], False)
    # What one poll acquired: two runs on partition 0, one on partition 3.
    s.holding = session_mod.Holding(batch=1, slot=0, acquired={"t": {0: [[10, 19], [30, 34]], 3: [[0, 9]]}},
                                    rows=25, acquired_at=0.0)
    yield s, made[0], refuse
    s.close().result(5)


HELD = [("t", 0, o) for o in [*range(10, 20), *range(30, 35)]] + [("t", 3, o) for o in range(10)]


def test_every_held_record_is_accepted_once_in_offset_order(session):
    s, consumer, _ = session
    out = s.acknowledge(None, 5).result(5)
    assert consumer.acked == [(*r, ACCEPT) for r in HELD]
    assert (out.accepted, out.failed) == (25, 0) and consumer.commits == 1 and s.holding is None


def test_a_refused_record_is_counted_and_the_rest_of_its_run_still_acknowledged(session):
    s, consumer, refuse = session
    refuse.update({("t", 0, 13), ("t", 0, 34), ("t", 3, 0)})  # mid-run, last of a run, first of a run
    out = s.acknowledge(None, 5).result(5)
    assert consumer.acked == [(*r, ACCEPT) for r in HELD if r not in refuse]
    assert (out.accepted, out.failed) == (22, 3)
    assert out.errors == {"NotInFlight": 3}


def test_verdicts_pick_each_records_kind(session):
    s, consumer, refuse = session
    refuse.add(("t", 0, 15))
    verdicts = {("t", 0, 11): REJECT, ("t", 3, 9): RELEASE, ("t", 0, 15): REJECT}
    out = s.acknowledge(VerdictSet.from_records([(*r, k) for r, k in verdicts.items()]), 5).result(5)
    assert consumer.acked == [(*r, verdicts.get(r, ACCEPT)) for r in HELD if r not in refuse]
    assert (out.accepted, out.rejected, out.released, out.failed) == (22, 1, 1, 1)


def test_release_all_releases_every_held_record(session):
    s, consumer, _ = session
    out = s.release_all(5).result(5)
    assert consumer.acked == [(*r, RELEASE) for r in HELD]
    assert (out.released, out.accepted) == (25, 0)


class PollingConsumer(FakeShareConsumer):
    """Hands out ``polls`` (lists of messages) one per poll(), as a broker that acquires whole record
    batches hands out more than max.poll.records."""

    def __init__(self, conf, polls):
        super().__init__(conf, set())
        self.polls = list(polls)
        self.poll_calls = 0

    def poll(self, timeout):
        self.poll_calls += 1
        return self.polls.pop(0) if self.polls else []

    def acknowledge(self, msg, kind):
        self.acked.append((msg.topic(), msg.partition(), msg.offset(), kind))


def test_a_poll_bigger_than_its_batch_carries_the_excess_to_the_next_batch_without_releasing_it(monkeypatch):
    """The broker hands out 250 records to a poll that may take 100: the batch gets 100; the other 150
    stay acquired and are the next two polls' records, served without asking the broker (the client
    forbids a poll while any of the last one's records is unacknowledged). Nothing is released, so no
    record's delivery count grows from the batch size."""
    from test_records import Msg

    made = []

    def factory(conf):
        made.append(PollingConsumer(conf, [[Msg("t", i % 2, i // 2, b"k", b"v") for i in range(250)]]))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    s = session_mod.ShareSession("carry", {"group.id": "g"}, ["t"], False)
    try:
        consumer = made[0]
        sizes = []
        for batch in range(1, 4):
            rb, holding = s.poll(batch, 0, 100, 1000).result(5)
            sizes.append(rb.num_rows)
            assert s.carrying == max(0, 250 - sum(sizes))
            s.acknowledge(None, 5).result(5)
        assert sizes == [100, 100, 50] and consumer.poll_calls == 1
        kinds = {kind for *_, kind in consumer.acked}
        assert kinds == {ACCEPT} and len(consumer.acked) == 250 == len(set(consumer.acked))
        assert consumer.commits == 3
    finally:
        s.close().result(5)


def test_a_poll_past_its_grant_hands_out_what_the_batch_has_room_for(monkeypatch):
    """Issue 48: a poll granted 100 brings 112 (whole producer batches). It asks how many more it may hand out;
    what the batch's cap has room for goes out now, only the rest is carried (carried, the 12 were the
    session's whole next read: it may not poll before they are acknowledged)."""
    from test_records import Msg

    made = []

    def factory(conf):
        made.append(PollingConsumer(conf, [[Msg("t", 0, i, b"k", b"v") for i in range(112)],
                                           [Msg("t", 0, 112 + i, b"k", b"v") for i in range(112)]]))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    s = session_mod.ShareSession("more", {"group.id": "g"}, ["t"], False)
    asked = []
    try:
        rb, holding = s.poll(1, 0, 100, 1000, more=lambda n: asked.append(n) or n).result(5)
        assert rb.num_rows == 112 and s.carrying == 0 and asked == [12]
        assert holding.acquired == {"t": {0: [[0, 111]]}}
        s.acknowledge(None, 5).result(5)
        rb, _ = s.poll(2, 0, 100, 1000, more=lambda n: 5).result(5)
        assert rb.num_rows == 105 and s.carrying == 7, "the room the batch has, the rest carried"
        assert made[0].poll_calls == 2
    finally:
        s.close().result(5)


def test_carried_records_too_old_for_the_lock_are_released_not_handed_out(monkeypatch):
    """A poll acquired far more than its batch (the broker hands out whole record batches): what the next
    polls cannot hand out while younger than the carry limit is released at once, before its lock
    expires; the poll after that asks the broker again."""
    from test_records import Msg

    made = []

    def factory(conf):
        made.append(PollingConsumer(conf, [[Msg("t", 0, i, b"k", b"v") for i in range(1000)],
                                           [Msg("t", 0, 1000, b"k", b"v")]]))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    s = session_mod.ShareSession("carry-old", {"group.id": "g"}, ["t"], False)
    try:
        consumer = made[0]
        rb, _ = s.poll(1, 0, 100, 1000, carry_ms=10_000).result(5)
        s.acknowledge(None, 5).result(5)
        assert rb.num_rows == 100 and s.carrying == 900
        s._carried_at -= 20  # the carried records are 20 s old now: past a 10 s carry limit
        rb, holding = s.poll(2, 0, 100, 1000, carry_ms=10_000).result(5)
        assert rb.num_rows == 1 and holding.acquired == {"t": {0: [[1000, 1000]]}} and s.carrying == 0
        released = [off for _, _, off, kind in consumer.acked if kind == RELEASE]
        assert released == list(range(100, 1000)) and s.released_old == 900
        assert consumer.poll_calls == 2
    finally:
        s.close().result(5)


def _stats(at: float, received: int) -> str:
    """librdkafka's statistics text as far as it says when it was taken and how many messages came so far."""
    return json.dumps({"ts": int(at * 1e6), "replyq": 0, "rxmsgs": received, "rxmsg_bytes": 0})


class FetchingConsumer(PollingConsumer):
    """Polls as PollingConsumer once ``fetched`` is set (nothing before); each poll's messages came ``ago``
    seconds before it, which the statistics served inside the poll say, as librdkafka's do: a text before
    they came, then one counting them."""

    def __init__(self, conf, polls, ago):
        super().__init__(conf, polls)
        self.stats_cb = conf["stats_cb"]
        self.ago = list(ago)
        self.received = 0
        self.fetched = False

    def poll(self, timeout):
        msgs = super().poll(timeout) if self.fetched else []
        if msgs:
            came = time.monotonic() - self.ago.pop(0)
            self.stats_cb(_stats(came - 0.001, self.received))
            self.received += len(msgs)
            self.stats_cb(_stats(came, self.received))
        return msgs


@pytest.mark.parametrize("fetched_ago_s, released", [(0.0, False), (0.3, True)])
def test_records_fetched_while_no_poll_ran_and_too_old_for_the_lock_are_released_before_a_batch_sees_them(
        monkeypatch, fetched_ago_s, released):
    """After a poll that returned nothing, librdkafka fetches on its own and keeps what comes for the next
    poll; the broker's lock runs from then (a long trigger leaves it there for minutes). Records the
    statistics say came longer ago than the carry limit are released at once and polled again, with a
    fresh lock; records that came just now are handed out, their acquisition time the statistics' one."""
    from test_records import Msg

    made = []
    first = [Msg("t", 0, i, b"k", b"v") for i in range(5)]

    def factory(conf):
        made.append(FetchingConsumer(conf, [first, list(first)], [fetched_ago_s, 0.0]))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "ShareConsumer", factory)
    s = session_mod.ShareSession("fetched-idle", {"group.id": "g"}, ["t"], False, join_wait_s=0)
    try:
        consumer = made[0]
        rb, held = s.poll(0, 0, None, 50).result(5)
        assert rb.num_rows == 0
        consumer.fetched = True
        idle_from = time.monotonic()
        wait_until(lambda: time.monotonic() - idle_from > 0.35, timeout=5)  # no poll runs meanwhile
        rb, held = s.poll(1, 0, None, 1000, carry_ms=200).result(5)
        assert rb.num_rows == 5 and held.acquired == {"t": {0: [[0, 4]]}}
        assert [off for _, _, off, kind in consumer.acked if kind == RELEASE] == (list(range(5)) if released else [])
        assert s.released_old == (5 if released else 0)
        assert len(consumer.polls) == (0 if released else 1), "polled again only after a release"
        assert time.time() - held.acquired_at < 0.2, "handed out with its lock's age"
    finally:
        s.close().result(5)


def test_statistics_say_when_records_came_while_no_poll_ran():
    from spark_share.consumers.session_stats import FetchStats

    f = FetchStats()
    now = time.monotonic()
    f.on_stats(_stats(now - 1.0, 7))
    f.mark(now - 0.5, 7)  # a poll returned the 7 the client had received
    assert f.fetched_after is None
    f.on_stats(_stats(now - 0.6, 9))  # taken before the poll returned: what it counts was handed out
    f.on_stats(_stats(now - 0.4, 9))
    f.on_stats(_stats(now - 0.3, 9))
    assert f.fetched_after is None
    f.on_stats(_stats(now - 0.2, 12))
    f.on_stats(_stats(now - 0.1, 15))
    assert f.fetched_after == pytest.approx(now - 0.3, abs=1e-6), "from the last text before they came"
    # A poll that handed out records which came after the last text before it: the next text counts them.
    f.mark(now, 6)
    assert f.fetched_after is None
    f.on_stats(_stats(now + 0.1, 21))
    f.on_stats(_stats(now + 0.2, 21))
    assert f.fetched_after is None
    # The fetch in flight when a poll returned empty, answered before the next text (seen on Kafka 4.2):
    # that first text already counts what it brought, which came after the poll returned.
    f.mark(now + 0.25, 0)
    f.on_stats(_stats(now + 0.3, 41))
    assert f.fetched_after == pytest.approx(now + 0.25, abs=1e-6)
    # The count runs ahead of what polls hand out (librdkafka counts whole producer batches, then keeps
    # the records acquired): no total is kept, each poll takes its own base.
    f.mark(now + 0.35, 5)
    f.on_stats(_stats(now + 0.4, 60))
    f.on_stats(_stats(now + 0.5, 60))
    f.mark(now + 0.55, 0)
    f.on_stats(_stats(now + 0.6, 60))
    assert f.fetched_after is None
