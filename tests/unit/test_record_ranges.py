"""``record_ranges``: a batch's records as the offset names them (compact, bounded at 2,000 partitions, read
back exactly), what is missing of them, and how a session sorts one poll by them."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from spark_share.errors import SourceError
from spark_share.offsets import offset_of, pending_of, records_of, reported
from spark_share.record_ranges import RecordRanges, RecordSorter


class Msg:
    """What a session sorts: confluent-kafka's Message accessors."""

    def __init__(self, topic: str, partition: int, offset: int):
        self._t, self._p, self._o = topic, partition, offset

    def topic(self):
        return self._t

    def partition(self):
        return self._p

    def offset(self):
        return self._o

    def __repr__(self):
        return f"{self._t}-{self._p}@{self._o}"


def ranges_like_a_batch(partitions: int, seed: int = 1, runs_per_partition: int = 1) -> RecordRanges:
    """One batch at Kafka's default lock budget: up to 2,000 records per partition, far into the log."""
    rng = random.Random(seed)
    runs = {}
    for p in range(partitions):
        at, rs = rng.randrange(10**9), []
        for _ in range(runs_per_partition):
            n = rng.randrange(1, 2000 // runs_per_partition)
            rs.append([at, at + n - 1])
            at += n + rng.randrange(1, 50)  # a gap: records another member holds
        runs[("orders", p)] = rs
    return RecordRanges(runs)


def test_what_slots_acquired_is_merged_per_partition_and_read_back_exactly():
    acquired = [{"offsets": {"t": {"0": [[0, 9], [20, 29]], "1": [[5, 5]]}}},
                {"offsets": {"t": {"0": [[10, 14]]}, "u": {"3": [[100, 199]]}}}, {"rows": 0}]
    r = RecordRanges.of_acquired(acquired)
    assert r.runs == {("t", 0): [(0, 14), (20, 29)], ("t", 1): [(5, 5)], ("u", 3): [(100, 199)]}
    assert len(r) == 15 + 10 + 1 + 100
    assert RecordRanges.decode(r.encode()) == r
    assert records_of(offset_of(4, "run1", None, r)) == r
    assert records_of(offset_of(4, "run1")) is None  # readMode=executors, or an older offset


def test_an_offset_with_records_is_still_ours_in_a_progress_report():
    text = json.dumps(offset_of(5, "abcd", None, RecordRanges({("t", 0): [(0, 9)]})))
    assert reported(text) == (5, "abcd", None)


@pytest.mark.parametrize("partitions, runs, bound", [(8, 1, 200), (8, 5, 400), (2000, 1, 18_000)])
def test_the_offsets_records_stay_small(partitions, runs, bound):
    """The offset is in every progress report (start and end): at 8 partitions a few hundred bytes; at 2,000,
    one run each (records far into the log, at random), about 17 KB: the offsets themselves, which do not compress."""
    r = ranges_like_a_batch(partitions, runs_per_partition=runs)
    text = json.dumps(offset_of(123, "0123456789abcdef", None, r))
    print(f"{partitions} partitions x {runs} runs: {len(text)} bytes")
    assert len(text) <= bound
    assert RecordRanges.decode(json.loads(text)["records"]) == r


@pytest.mark.parametrize("partitions, bound", [(8, 400), (2000, 36_000)])
def test_an_offset_naming_pending_records_too_stays_within_twice_the_size(partitions, bound):
    """Pending records (an earlier committed batch's that have not come back) are at most that batch's: an
    offset naming its own records and those of the batch before is at most about twice one that names its own."""
    mine = ranges_like_a_batch(partitions, runs_per_partition=1)
    earlier = ranges_like_a_batch(partitions, seed=2, runs_per_partition=1)
    text = json.dumps(offset_of(124, "0123456789abcdef", None, mine, pending=(1765100000.123, earlier)))
    print(f"{partitions} partitions, with pending records: {len(text)} bytes")
    assert len(text) <= bound
    assert pending_of(json.loads(text)) == (1765100000.123, earlier)


def test_membership_and_what_is_missing():
    r = RecordRanges({("t", 0): [(10, 19), (30, 30)], ("t", 1): [(0, 4)]})
    assert [o for o in range(40) if r.contains("t", 0, o)] == list(range(10, 20)) + [30]
    assert r.mask("t", 0, np.arange(8, 32)).tolist() == [r.contains("t", 0, o) for o in range(8, 32)]
    assert not r.mask("t", 7, np.arange(3)).any()
    got = RecordRanges({("t", 0): [(12, 15), (30, 31)], ("u", 0): [(0, 1)]})
    assert r.minus(got).runs == {("t", 0): [(10, 11), (16, 19)], ("t", 1): [(0, 4)]}
    assert len(r.minus(r)) == 0
    assert r.union(got).runs[("t", 0)] == [(10, 19), (30, 31)]


@pytest.mark.parametrize("text", ["", "z1:", "z1:!!!", "z2:eJwDAAAAAAE=", "z1:" + "A" * 8,
                                  "z1:eJyrVkpJTbFSiFYqLknNTVWKBQAzHQWd"])
def test_records_that_are_not_ours_are_a_clear_error(text):
    with pytest.raises(SourceError, match="new checkpointLocation"):
        RecordRanges.decode(text)


def test_a_session_sorts_a_poll_into_the_batchs_the_committed_and_the_next_batchs():
    sorter = RecordSorter()
    poll = [Msg("t", p, o) for p in (0, 1) for o in range(10)] + [Msg("u", 0, 3)]
    assert sorter.sort(7, poll) == (poll, [], [])  # nothing to sort by: every record is the batch's
    sorter.commit(RecordRanges({("t", 0): [(0, 2)]}))
    sorter.commit(RecordRanges({("t", 1): [(9, 9)]}))  # a second committed batch adds to the first
    mine, done, later = sorter.sort(7, poll)
    assert [repr(m) for m in done] == ["t-0@0", "t-0@1", "t-0@2", "t-1@9"]
    assert len(mine) == len(poll) - 4 and not later
    sorter.replay(8, RecordRanges({("t", 0): [(2, 5)], ("u", 0): [(3, 3)]}))
    mine, done, later = sorter.sort(8, poll)
    assert [repr(m) for m in mine] == ["t-0@3", "t-0@4", "t-0@5", "u-0@3"]  # a committed one is never the batch's
    assert [repr(m) for m in done] == ["t-0@0", "t-0@1", "t-0@2", "t-1@9"]
    assert {repr(m) for m in later} == {repr(m) for m in poll} - {repr(m) for m in mine + done}
    assert sorter.accepted_again == 8
    sorter.replayed(8)
    assert sorter.wanted(8) is None and len(sorter.sort(8, poll)[0]) == len(poll) - 4


def test_a_replay_waits_for_its_missing_records_only_while_the_ones_it_holds_keep_their_lock(monkeypatch):
    """Once a poll brought some of a replayed batch's records, their lock runs: the others are waited for
    ``hold_s`` at most, so that the batch reaches Spark before the held ones expire."""
    now = [100.0]
    monkeypatch.setattr("spark_share.record_ranges.time.monotonic", lambda: now[0])
    sorter = RecordSorter()
    sorter.replay(4, RecordRanges({("t", 0): [(0, 9)], ("t", 1): [(0, 9)]}), hold_s=15.0)
    now[0] += 40  # nothing brought yet (a lost run's records come back when their lock expires): still waiting
    assert sorter.waiting(4)
    sorter.sort(4, [Msg("t", 0, o) for o in range(10)])
    now[0] += 14.9
    assert sorter.waiting(4)
    now[0] += 0.2
    assert not sorter.waiting(4), "the held records' lock runs: the replay goes on without partition 1"
    sorter.sort(4, [Msg("t", 1, o) for o in range(10)])
    assert not sorter.waiting(4)
    sorter.replayed(4)
    sorter.replay(5, RecordRanges({("t", 0): [(0, 1)]}))
    assert sorter.waiting(5)
    sorter.sort(5, [Msg("t", 0, 0), Msg("t", 0, 1)])
    assert not sorter.waiting(5), "every record came"


def test_a_batch_being_accepted_is_committed_until_the_broker_took_it_and_for_good_if_it_refused():
    """While a committed batch's ACCEPTs are on their way, a record of it that comes back (its lock expired
    before the commit) is ACCEPTed unseen; once the broker took them all the set forgets the batch (an ACCEPTed
    record never comes back); a batch whose ACCEPT was refused stays committed."""
    sorter = RecordSorter()
    poll = [Msg("t", 0, o) for o in range(6)]
    sorter.accepting(1, RecordRanges({("t", 0): [(0, 1)]}))
    sorter.accepting(2, RecordRanges({("t", 0): [(2, 3)]}))
    assert sorter.active and [repr(m) for m in sorter.sort(3, poll)[1]] == ["t-0@0", "t-0@1", "t-0@2", "t-0@3"]
    sorter.accepted(1, refused=False)
    sorter.accepted(2, refused=True)
    assert [repr(m) for m in sorter.sort(3, poll)[1]] == ["t-0@2", "t-0@3"]
    sorter.commit(RecordRanges({("t", 0): [(5, 5)]}))  # an earlier run's committed batch: kept beside it
    assert [repr(m) for m in sorter.sort(3, poll)[1]] == ["t-0@2", "t-0@3", "t-0@5"]
    assert sorter.accepted_again == 4 + 2 + 3
    clean = RecordSorter()
    clean.accepting(1, RecordRanges({("t", 0): [(0, 5)]}))
    clean.accepted(1, refused=False)
    assert not clean.active and clean.sort(3, poll) == (poll, [], [])


def test_committed_records_that_have_not_come_back_go_forward_in_the_next_offset_until_the_horizon(monkeypatch):
    import spark_share.record_ranges as rr
    from spark_share.offsets import pending_of

    now = [1000.0]
    monkeypatch.setattr(rr.time, "time", lambda: now[0])
    s = RecordSorter()
    assert s.pending(60) is None
    s.commit(RecordRanges({("t", 0): [[0, 99]], ("t", 1): [[0, 49]]}))  # an earlier run's batch, from its offset
    mine, done, later = s.sort(1, [Msg("t", 0, o) for o in range(100)] + [Msg("t", 0, 100)])
    assert len(done) == 100 and [m.offset() for m in mine] == [100]
    since, left = s.pending(60)
    assert since == 1000.0 and left == RecordRanges({("t", 1): [[0, 49]]}), "only what has not come back"

    # The next run starts from that offset: it ACCEPTs them when they come back, and carries them on with
    # the time they first became pending.
    offset = json.loads(json.dumps(offset_of(1, "run-b", records=RecordRanges({("t", 0): [[100, 100]]}),
                                             pending=s.pending(60))))
    assert reported(json.dumps(offset)) == (1, "run-b", None)
    nxt = RecordSorter()
    got = pending_of(offset)
    assert got is not None
    since, ranges = got
    nxt.commit(ranges, since)
    _, done, _ = nxt.sort(2, [Msg("t", 1, 7)])
    assert [m.offset() for m in done] == [7]
    now[0] += 30
    assert nxt.pending(60)[0] == 1000.0
    now[0] += 31
    assert nxt.pending(60) is None, "past the horizon they came back or were acknowledged"
    assert pending_of(offset_of(3, "run-c")) is None
