"""A session acknowledges every record it holds exactly once, with the verdict asked for, and counts
the ones the client refuses (no longer in flight) without stopping at them: a fake ShareConsumer
records each acknowledge_offset call and refuses the offsets a test names."""
from __future__ import annotations

import confluent_kafka
import pytest

from spark_share import session as session_mod
from spark_share.batches import ACCEPT, REJECT, RELEASE


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
    out = s.acknowledge({}, 5).result(5)
    assert consumer.acked == [(*r, ACCEPT) for r in HELD]
    assert (out.accepted, out.failed) == (25, 0) and consumer.commits == 1 and s.holding is None


def test_a_refused_record_is_counted_and_the_rest_of_its_run_still_acknowledged(session):
    s, consumer, refuse = session
    refuse.update({("t", 0, 13), ("t", 0, 34), ("t", 3, 0)})  # mid-run, last of a run, first of a run
    out = s.acknowledge({}, 5).result(5)
    assert consumer.acked == [(*r, ACCEPT) for r in HELD if r not in refuse]
    assert (out.accepted, out.failed) == (22, 3)
    assert out.errors == {"NotInFlight": 3}


def test_verdicts_pick_each_records_kind(session):
    s, consumer, refuse = session
    refuse.add(("t", 0, 15))
    verdicts = {("t", 0, 11): REJECT, ("t", 3, 9): RELEASE, ("t", 0, 15): REJECT}
    out = s.acknowledge(verdicts, 5).result(5)
    assert consumer.acked == [(*r, verdicts.get(r, ACCEPT)) for r in HELD if r not in refuse]
    assert (out.accepted, out.rejected, out.released, out.failed) == (22, 1, 1, 1)


def test_release_all_releases_every_held_record(session):
    s, consumer, _ = session
    out = s.release_all(5).result(5)
    assert consumer.acked == [(*r, RELEASE) for r in HELD]
    assert (out.released, out.accepted) == (25, 0)
