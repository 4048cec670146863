"""The batch policy alone: when a batch runs, how big it may be, when AvailableNow ends (no Spark, no Kafka)."""
import logging

import pytest

from spark_share.acknowledgement import AckOutcome
from spark_share.driver.acks import log_batch
from spark_share.driver.batches import BatchState
from spark_share.driver.drain_policy import (
    AVAILABLE_NOW_EMPTY_RETRIES,
    AVAILABLE_NOW_UNANSWERED_S,
    AVAILABLE_NOW_UNRESOLVED_S,
)
from spark_share.driver.policy import (
    DEFAULT_LOCK_MS,
    GROW_AFTER_BATCHES,
    PARALLELISM_ENV,
    BatchPolicy,
    default_slots,
)
from spark_share.errors import SourceError


def batch(n, rows_by_partition=None, slots=2, max_records=None, **outcome) -> BatchState:
    """A batch whose slot i acquired offsets [first, last] of ("t", i), rows = last - first + 1."""
    b = BatchState(n, slots, max_records)
    for slot, (first, last) in enumerate(rows_by_partition or []):
        b.acquired[slot] = {"agent": "a", "rows": last - first + 1, "acquired_at": 100.0,
                            "offsets": {"t": {str(slot): [[first, last]]}}}
    b.outcome = AckOutcome(**outcome)
    return b


def saw(p: BatchPolicy, b: BatchState) -> None:
    for a in b.acquired.values():
        p.acquired(a["offsets"], 0)


# --- default and processingTime triggers ---------------------------------------------------------
def test_the_first_batch_always_runs_then_records_keep_it_going():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    assert p.should_run(None, hw_version=0, now=0.0)
    p.planned(hw_version=0, now=0.0)
    assert p.should_run(batch(0, [(0, 9)]), hw_version=0, now=0.1) and not p.idle


def test_an_idle_stream_waits_for_new_records_or_the_probe():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.planned(hw_version=3, now=100.0)
    empty = batch(0)
    assert not p.should_run(empty, hw_version=3, now=105.0) and p.idle
    assert p.should_run(empty, hw_version=4, now=105.0), "moved high watermarks mean new records"
    assert p.should_run(empty, hw_version=3, now=110.0), "the idle probe is due"


def test_records_given_back_run_another_batch_at_once():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.planned(hw_version=0, now=0.0)
    for kind in ("released", "failed", "expired"):
        assert p.should_run(batch(0, **{kind: 1}), hw_version=0, now=0.0), kind


# --- AvailableNow ------------------------------------------------------------------------------------
def available_now(high) -> BatchPolicy:
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.start_available_now(high)
    return p


def test_available_now_ends_once_everything_below_the_start_was_seen():
    p = available_now({("t", 0): 10, ("t", 1): 5})
    assert p.should_run(None, 0, 0.0)
    p.planned(0, 0.0)
    b0 = batch(0, [(0, 9), (0, 2)])
    saw(p, b0)
    assert not p.seen_all() and p.should_run(b0, 0, 0.0)
    b1 = BatchState(1, 1, None)
    b1.acquired[0] = {"agent": "a", "rows": 2, "offsets": {"t": {"1": [[3, 4]]}}}
    saw(p, b1)
    assert p.seen_all()
    assert p.should_run(b1, 0, 0.0) and p.closing, "one last batch acknowledges and reports"
    assert p.slots_of_new_batch(None) == 0, "the closing batch has no read tasks"
    assert not p.should_run(batch(2, slots=0), 0, 0.0)


def answered(n, *partitions, slots=1) -> BatchState:
    """An empty batch whose polls the broker answered for these partitions (nothing available there)."""
    b = BatchState(n, slots, None)
    b.acquired[0] = {"agent": "a", "rows": 0, "offsets": {}, "answered": [list(tp) for tp in partitions]}
    return b


def heard(p: BatchPolicy, b: BatchState) -> None:
    for a in b.acquired.values():
        p.acquired(a["offsets"], 0)
        p.answered_empty(a.get("answered", []))


def test_an_empty_batch_ends_no_drain_while_a_partition_was_answered_by_no_poll():
    """Issue 41: a drain on three hosts ended after one empty batch with every record of one partition
    unread (no error): the run had never acquired from it, and its member was polled by no read task
    of that batch. An empty batch proves a partition drained only when a poll of ours had it assigned
    and the broker answered that fetch with nothing."""
    p = available_now({("t", 0): 300, ("t", 1): 300, ("t", 2): 300, ("t", 3): 300})
    p.planned(0, 0.0)
    b0 = BatchState(0, 3, None)
    for slot in range(3):
        b0.acquired[slot] = {"agent": "a", "rows": 300, "offsets": {"t": {str(slot): [[0, 299]]}}}
    heard(p, b0)
    assert p.should_run(b0, 0, 0.0)
    # The polls of the next batch answered empty for partitions 0-2; nobody polled partition 3.
    empty = answered(1, ("t", 0), ("t", 1), ("t", 2))
    heard(p, empty)
    assert p.unresolved() == [("t", 3)]
    assert p.should_run(empty, 0, 1.0), "ended with partition 3 unread"
    b2 = BatchState(2, 1, None)
    b2.acquired[0] = {"agent": "a", "rows": 300, "offsets": {"t": {"3": [[0, 299]]}}}
    heard(p, b2)
    assert p.unresolved() == [] and p.should_run(b2, 0, 2.0) and p.closing


def test_a_drain_waits_a_bounded_time_for_partitions_no_poll_answers_then_says_which():
    p = available_now({("t", 0): 100, ("t", 1): 100})
    p.planned(0, 0.0)
    b0 = batch(0, [(0, 99)])
    heard(p, b0)
    assert p.should_run(b0, 0, 0.0)
    runs = [p.should_run(answered(n, ("t", 0)), 0, float(n)) for n in range(1, 30)]
    assert all(runs) and p.left_unread == []
    assert not p.should_run(answered(30, ("t", 0)), 0, AVAILABLE_NOW_UNRESOLVED_S + 2.0)
    assert p.left_unread == [("t", 1)], "the partition it gave up on"


def test_records_given_back_keep_an_answered_drain_going_a_bounded_number_of_batches():
    p = available_now({("t", 0): 100})
    p.planned(0, 0.0)
    b0 = batch(0, [(0, 9)], released=5)
    heard(p, b0)
    p.acknowledged(b0)
    assert p.should_run(b0, 0, 0.0)
    runs = []
    for n in range(1, AVAILABLE_NOW_EMPTY_RETRIES + 2):
        empty = answered(n, ("t", 0))
        heard(p, empty)
        runs.append(p.should_run(empty, 0, 0.0))
    assert runs == [True] * AVAILABLE_NOW_EMPTY_RETRIES + [False], "the 5 records it released are due back"


def timed_out(n, slots=2) -> BatchState:
    """A batch whose polls acquired nothing because they ran out of time (no fetch came back)."""
    b = BatchState(n, slots, None)
    for slot in range(slots):
        b.acquired[slot] = {"agent": "a", "rows": 0, "offsets": {}, "timed_out": True}
    return b


def test_available_now_goes_on_while_its_first_polls_run_out_of_time_on_a_full_queue():
    """A first fetch behind a big backlog can outlast a poll: ending the run then would drain nothing
    (240,000 records on the embedded broker, pollTimeoutMs=300: the run ended with 0 rows). Until the
    run has acquired something it goes on while the broker answers none of its polls, for
    AVAILABLE_NOW_UNANSWERED_S, then fails saying so; after that, such a batch is an empty batch."""
    p = available_now({("t", 0): 100_000, ("t", 1): 100_000})
    assert p.should_run(None, 0, 0.0)
    p.planned(0, 0.0)
    assert timed_out(0).timed_out and not batch(0).timed_out
    n = AVAILABLE_NOW_EMPTY_RETRIES * 4
    assert all(p.should_run(timed_out(i), 0, float(i)) for i in range(n)), "not bounded by the empty retries"
    b = batch(n, [(0, 9)])  # an answer at last
    saw(p, b)
    assert p.should_run(b, 0, float(n)) and p.unanswered_since is None
    later = n + 1 + AVAILABLE_NOW_UNRESOLVED_S
    assert p.should_run(timed_out(n + 1), 0, float(n + 1)), "once records came, an empty batch waits for answers"
    assert not p.should_run(timed_out(n + 2), 0, later + 1), "for AVAILABLE_NOW_UNRESOLVED_S at most"
    assert p.left_unread == [("t", 0), ("t", 1)]


def test_available_now_fails_when_the_broker_answers_no_poll_for_too_long():
    p = available_now({("t", 0): 100_000})
    p.planned(0, 0.0)
    assert p.should_run(timed_out(0), 0, 1000.0)
    with pytest.raises(SourceError, match="answered none of this run's polls for 1[0-9]{2} s.*nothing was skipped"):
        p.should_run(timed_out(1), 0, 1000.0 + AVAILABLE_NOW_UNANSWERED_S + 1)


def test_available_now_on_a_drained_queue_ends_after_its_first_empty_answer():
    """Records below the start's watermarks that earlier runs acknowledged are never seen again: a poll
    the broker answered empty for the partition ends the run at once."""
    p = available_now({("t", 0): 100_000})
    p.planned(0, 0.0)
    empty = answered(0, ("t", 0))
    heard(p, empty)
    assert not p.should_run(empty, 0, 0.0) and p.left_unread == []


def test_available_now_waits_for_records_it_gave_back():
    p = available_now({("t", 0): 10})
    p.planned(0, 0.0)
    b0 = batch(0, [(0, 9)], released=4)
    saw(p, b0)
    assert p.needs_acknowledgements(b0) is True, "the run may end here: the answers decide"
    p.acknowledged(b0)
    assert p.redeliveries_due == 4
    assert p.should_run(b0, 0, 0.0) and not p.closing
    assert p.should_run(batch(1), 0, 0.0), "an empty poll while 4 are due goes on"
    p.acquired({"t": {"0": [[2, 5]]}}, redelivered=4)
    assert p.redeliveries_due == 0


def test_a_drain_that_starts_after_its_first_batch_waits_for_what_that_batch_released():
    """Spark < 4.2: spark_share.drain() runs the default trigger and the tracker drains from the listener's
    first call, after batch 0 was acknowledged. Its releases are due all the same: a batch that brings back
    some of them does not end the run (the job under Connect on 4.1 ended with 8 of 28 unread)."""
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.planned(0, 0.0)
    b0 = batch(0, [(0, 9)], released=3)
    saw(p, b0)
    p.acknowledged(b0)
    p.start_available_now({("t", 0): 10})
    b1 = batch(1, [(2, 2)])
    p.acquired({"t": {"0": [[2, 2]]}}, redelivered=1)
    assert p.should_run(b1, 0, 0.0) and not p.closing, "2 released records are still to come back"
    assert p.should_run(batch(2), 0, 0.0), "an empty poll while 2 are due goes on"
    p.acquired({"t": {"0": [[3, 4]]}}, redelivered=2)
    assert p.redeliveries_due == 0


def test_available_now_ends_when_a_batch_brought_only_newer_records():
    p = available_now({("t", 0): 10, ("t", 1): 10})
    p.planned(0, 0.0)
    b = BatchState(0, 1, None)
    b.acquired[0] = {"agent": "a", "rows": 5, "offsets": {"t": {"0": [[20, 24]]}}}
    p.acquired(b.acquired[0]["offsets"], 0)
    assert p.should_run(b, 0, 0.0), "partition 1 is still to be answered"
    p.answered_empty([("t", 1)])
    assert not p.should_run(b, 0, 0.0)


def test_default_trigger_never_waits_for_acknowledgements():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.planned(0, 0.0)
    assert not p.needs_acknowledgements(batch(0))


# --- slots, budgets and the record lock ----------------------------------------------------------------
def test_slots_and_budgets_follow_max_records_per_trigger():
    p = BatchPolicy(num_slots=4, idle_probe_ms=10_000, max_records_per_trigger=1000)
    assert p.slots_for(None) == 4 and p.slots_for(2) == 2 and p.slots_for(1000) == 4
    assert p.slot_budgets(BatchState(0, 4, 1000)) == [250] * 4
    assert p.slot_budgets(BatchState(0, 4, None)) == [None] * 4
    assert p.poll_size(None) == 250, "before any batch: maxRecordsPerTrigger over the slots"


def test_the_batch_cap_goes_first_to_reads_whose_sessions_carry_records():
    """Kafka hands a fetch whole producer batches: a session may carry far more than its share. Its read
    may take what is left of the cap, and reads claimed after the cap is spent acquire nothing."""
    p = BatchPolicy(num_slots=3, idle_probe_ms=10_000, max_records_per_trigger=300)
    b = BatchState(0, 3, 300)
    assert p.grant(b, 0, carrying=900) == 300, "a carrier takes the whole cap"
    b.granted[0] = b.granted_total = 300
    assert p.grant(b, 1, carrying=0) == 0 and p.grant(b, 2, carrying=500) == 0, "nothing left: no new polls"
    even = BatchState(1, 3, 300)
    assert [p.grant(even, s, 0) for s in range(3)] == [100] * 3, "no carry: the even share"
    even.granted, even.granted_total = {0: 100, 1: 100}, 200
    assert p.grant(even, 2, carrying=150) == 100, "never more than what is left"
    p.lock_safe_records = 120
    assert p.grant(BatchState(2, 3, 300), 0, carrying=900) == 120, "lock-safe records per consumer still cap it"
    assert p.grant(BatchState(3, 3, None), 0, carrying=900) == 120, "no batch cap: the lock-safe share, as planned"
    ahead = BatchState(4, 3, 300)
    ahead.prefetched = True
    assert p.grant(ahead, 0, carrying=900) == 100, "polled ahead at planning: the shares the polls started with"
    late = BatchState(5, 3, 300)
    late.granted, late.granted_total = {0: 300}, 300
    p.lock_safe_records = None
    assert p.grant(late, 1, carrying=900) == 0, "the cap is never exceeded, however much is carried"


def test_the_cap_a_batch_leaves_unused_goes_to_a_read_that_polled_more():
    """Issue 48: three slots of a 300 cap, members capped below the topic's four partitions (on Kafka each has
    partitions of its own; after a host loss one holds two). A poll brings whole producer batches (112 for a
    share of 100), and where only one member's partitions have records the others find nothing. What the
    batch leaves unused, slots not claimed yet and reads that handed out less than granted, goes to the read
    that polled more; carried, its extra were its session's whole next read (batches of 100, 12, 100, 12)."""
    p = BatchPolicy(num_slots=3, idle_probe_ms=10_000, max_records_per_trigger=300)
    b = BatchState(0, 3, 300)
    for slot in (0, 1):
        b.granted[slot] = p.grant(b, slot, carrying=0)
        b.granted_total += b.granted[slot]
    assert p.more(b, 0, 12) == 12 and b.granted[0] == 112, "slot 2 is not claimed yet: its share has room"
    p.unused(b, 1, 0)  # slot 1's member found nothing
    assert b.granted[1] == 0 and b.granted_total == 112
    b.granted[2] = p.grant(b, 2, carrying=0)
    b.granted_total += b.granted[2]
    assert b.granted[2] == 100
    assert p.more(b, 2, 500) == 88, "never past the cap"
    assert p.more(b, 0, 1) == 0 and b.granted_total == 300 == sum(b.granted.values())
    p.lock_safe_records = 120
    c = BatchState(1, 3, 300)
    c.granted, c.granted_total = {0: 100}, 100
    assert p.more(c, 0, 50) == 20, "the lock-safe records per consumer still cap a read"
    p.lock_safe_records = None
    ahead = BatchState(2, 3, 300)
    ahead.prefetched = True
    ahead.granted, ahead.granted_total = {0: 100}, 100
    assert p.more(ahead, 0, 12) == 0, "polled ahead: the even shares its polls started with"
    assert p.more(BatchState(3, 3, None), 0, 12) == 0, "no batch cap: nothing to share out"


def test_polls_take_their_share_of_the_lock_budget():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    p.partitions, p.record_locks = 8, 2000
    assert p.lock_budget == 16_000
    assert p.poll_size(None) == 8000, "two consumers fill the 16,000 records the group may hold"
    p.record_locks = 10_000
    assert p.poll_size(BatchState(0, 2, None)) == 40_000
    p.num_slots = 3
    assert p.poll_size(None) == 26_667, "rounded up: a consumer may hold more partitions than another"
    p.max_records_per_trigger = 3000
    assert p.poll_size(None) == 1000, "maxRecordsPerTrigger still caps it"
    wide = BatchPolicy(num_slots=8, idle_probe_ms=10_000)
    wide.partitions = 2
    assert wide.poll_size(None) == 500, "more consumers than partitions share two partitions' locks"


def test_lock_expiry_halves_what_a_consumer_may_take_and_learns_the_lock():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    assert p.lock_ms == DEFAULT_LOCK_MS
    b = batch(0, [(0, 799), (0, 399)], expired=1200)
    b.acked_at = 100.0 + 12.5  # held 12.5 s: the lock is shorter than that
    p.acknowledged(b)
    assert p.lock_safe_records == 400 and p.lock_ms == 12_500
    assert p.slot_budgets(BatchState(1, 2, None)) == [400, 400]
    assert p.slot_budgets(BatchState(1, 2, 600)) == [300, 300]
    small = batch(2, [(0, 99)], expired=100)
    small.acked_at = 100.0 + 20
    p.acknowledged(small)
    assert p.lock_safe_records == 50, "only ever lowered"
    assert p.close_to_lock(11_000) and not p.close_to_lock(5_000)
    assert p.headroom_ms(2_500.0) == 10_000.0


def test_after_lock_expiry_batches_that_fit_well_within_the_lock_grow_back():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    slow = batch(0, [(0, 399), (0, 399)], expired=800)
    slow.acked_at = 100.0 + 40  # one slow batch (a pause in the sink): 40 s, the lock is 30 s
    p.acknowledged(slow)
    assert p.lock_safe_records == 200

    def fits(n, held_s):
        b = batch(n, [(0, 199), (0, 199)])
        b.acked_at = 100.0 + held_s
        p.acknowledged(b)

    for n in range(1, GROW_AFTER_BATCHES):
        fits(n, held_s=1.0)
    assert p.lock_safe_records == 200, "not before enough batches fitted"
    fits(GROW_AFTER_BATCHES, held_s=20.0)  # more than half the lock: the count starts again
    for n in range(GROW_AFTER_BATCHES):
        fits(100 + n, held_s=1.0)
    assert p.lock_safe_records == 400
    for n in range(GROW_AFTER_BATCHES):
        fits(200 + n, held_s=1.0)
    assert p.lock_safe_records == 800, "doubles again while batches keep fitting"
    empty = batch(300, [])
    for _ in range(3 * GROW_AFTER_BATCHES):
        p.acknowledged(empty)
    assert p.lock_safe_records == 800, "empty batches say nothing about the lock"


def test_records_taken_back_sooner_than_a_batch_that_kept_them_are_not_a_lock_expiry(caplog):
    """A host lost, or the embedded broker ending every share session when a member disconnects:
    INVALID_RECORD_STATE after 1 s, when a batch held 5 s lately and kept its records, says nothing
    of the lock (learning a 1 s lock from it shrank batches to 1 record each, for good)."""
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    kept = batch(0, [(0, 399), (0, 399)])
    kept.acked_at = 100.0 + 5
    p.acknowledged(kept)
    taken = batch(1, [(0, 399), (0, 399)], expired=300)
    taken.acked_at = 100.0 + 1
    p.acknowledged(taken)
    assert p.lock_ms == DEFAULT_LOCK_MS and p.lock_safe_records is None
    with caplog.at_level(logging.WARNING, logger="spark_share.driver.tracker"):
        log_batch(taken, "g", p)
    assert "300 records were taken back after 1000 ms" in caplog.text and "locks expired" not in caplog.text
    expired = batch(2, [(0, 399), (0, 399)], expired=800)
    expired.acked_at = 100.0 + 6  # longer than any batch that kept its records: believed
    p.acknowledged(expired)
    assert p.lock_ms == 6_000 and p.lock_safe_records == 200
    with caplog.at_level(logging.WARNING, logger="spark_share.driver.tracker"):
        log_batch(expired, "g", p)
    assert "800 records' locks expired" in caplog.text and "at most 200 records per consumer" in caplog.text


def test_records_a_session_carries_keep_batches_running_until_handed_out():
    """A poll bigger than its batch's size leaves records acquired in its session (carried to its next
    poll): an AvailableNow run that has seen everything below the start does not end while any are
    carried, nor does an idle stream skip the batch that hands them out; a lost agent's go back."""
    p = BatchPolicy(num_slots=1, idle_probe_ms=10_000)
    p.start_available_now({("t", 0): 300})
    p.planned(0, 0.0)
    p.acquired({"t": {"0": [[0, 299]]}}, 0, ("a", "s1"), carried=50)  # the poll took 350, the batch 300
    assert p.seen_all() and p.carrying == 50
    assert p.should_run(batch(0, [(0, 299)], slots=1), hw_version=0, now=1.0) and not p.closing
    p.acquired({"t": {"0": [[300, 349]]}}, 0, ("a", "s1"), carried=0)
    assert p.carrying == 0
    assert p.should_run(batch(1, [(300, 349)], slots=1), hw_version=0, now=2.0) and p.closing

    q = BatchPolicy(num_slots=1, idle_probe_ms=10_000)
    q.planned(0, 0.0)
    q.acquired({"t": {"0": [[0, 9]]}}, 0, ("a", "s1"), carried=5)
    assert q.should_run(batch(1, [], slots=1), hw_version=0, now=1.0) and not q.idle
    q.forget_agent("a")
    assert not q.should_run(batch(2, [], slots=1), hw_version=0, now=2.0)


@pytest.mark.parametrize("partitions, parallelism, slots", [
    (8, "2", 2),       # local[2]: 8 tasks would queue four deep behind 2 cores
    (8, "16", 8),      # more cores than partitions: one consumer per partition, no idle ones
    (3, None, 3),      # register() did not pass it (Connect without spark.default.parallelism)
    (3, "", 3),
    (3, "junk", 3),
    (0, "4", 1),       # no partition yet (a topic being created): one slot, not none
])
def test_default_slots_are_the_topic_partitions_at_most_sparks_task_slots(partitions, parallelism, slots):
    assert default_slots(partitions, parallelism) == slots


def test_register_passes_sparks_parallelism_to_the_driver_side():
    """Classic sessions pass it in the SparkContext's environment (which Spark gives the source's
    runner); under Connect the subclass carries the server's spark.default.parallelism."""
    from types import SimpleNamespace

    import spark_share

    env = {}
    sc = SimpleNamespace(environment=env, master="local[3]", defaultParallelism=3,
                         getConf=lambda: SimpleNamespace(get=lambda k: None))
    spark_share._source_for(SimpleNamespace(sparkContext=sc))
    assert env[PARALLELISM_ENV] == "3" and env["SPARK_SHARE_MASTER"] == "local[3]"


def test_batches_prefetch_at_start_up_and_when_their_tasks_queue_for_sparks_slots():
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    assert p.prefetches(2), "nothing acquired yet: the first polls overlap the group join"
    p.acquired({"t": {"0": [[0, 9]]}}, 0)
    assert not p.prefetches(2), "Spark's slots unknown: the read tasks poll"
    p.task_slots = 2
    assert not p.prefetches(2) and p.prefetches(8), "8 tasks on 2 slots: the waiting ones' polls run early"


def test_a_drain_after_an_earlier_run_died_in_a_batch_waits_a_lock_for_its_records():
    """Spark replays a batch the earlier run planned and never committed: if that run died (its driver host
    lost), the records it held are locked until their lock expires and then come back, below what this run
    reads (it cannot see the gap: its view of a partition is the highest offset it read). The drain polls
    on until then, then ends as it would have."""
    p = available_now({("t", 0): 100})
    p.lock_ms = 15_000
    p.earlier_batch_replayed(7, now=1000.0)
    p.planned(0, 1000.0)
    b0 = batch(0, [(50, 99)])  # the records after the ones the dead run holds
    heard(p, b0)
    assert p.should_run(b0, 0, 1001.0) and not p.closing, "it saw all it could: no closing batch yet"
    assert p.waiting_for_locks and p.slots_of_new_batch(None) == 2, "it polls while it waits"
    empty = answered(1, ("t", 0))
    heard(p, empty)
    assert p.should_run(empty, 0, 1010.0), "within the lock: it waits"
    back = batch(2, [(0, 49)])  # the dead run's records, back once their lock expired
    heard(p, back)
    assert p.should_run(back, 0, 1014.0) and not p.closing, "still within the lock: it waits on"
    assert not p.should_run(answered(3, ("t", 0)), 0, 1016.0), "after the lock: it ends as it would"
    assert p.waiting_for_locks, "progress says why the drain ran longer"


def test_a_drain_after_a_run_that_stopped_holding_nothing_does_not_wait():
    """The run that planned the replayed batch stopped cleanly (its final counts on this host say it let go
    of that batch): nothing of it is locked, and the drain ends as soon as it has read everything."""
    p = available_now({("t", 0): 100})
    p.lock_ms = 15_000
    p.earlier_batch_replayed(7, now=1000.0)
    assert p.replayed_batch == 7
    p.earlier_run_let_go()
    p.planned(0, 1000.0)
    b0 = batch(0, [(0, 99)])
    heard(p, b0)
    assert p.should_run(b0, 0, 1001.0) and p.closing and not p.waiting_for_locks, "within the lock, it closes"
    assert not p.should_run(batch(1, slots=0), 0, 1001.5)


def _replayed_then_read_all():
    """A drain (15 s lock) that replays batch 7 of an earlier run at t=1000, then reads its partition whole."""
    p = available_now({("t", 0): 100})
    p.lock_ms = 15_000
    p.earlier_batch_replayed(7, now=1000.0)
    p.planned(0, 1000.0)
    b0 = batch(0, [(0, 99)])
    heard(p, b0)
    return p, b0


def test_a_drain_that_learns_late_that_the_run_let_go_stops_waiting():
    """The first decision can come before the query's id, which names the earlier run's final counts: the
    drain starts waiting for that run's locks, then learns it let go. It waits no longer, and progress does
    not say it waited for locked records (none were)."""
    p, b0 = _replayed_then_read_all()
    assert p.should_run(b0, 0, 1001.0) and p.waiting_for_locks, "not known yet: it waits"
    p.earlier_run_let_go()
    assert not p.waiting_for_locks
    assert not p.should_run(answered(1, ("t", 0)), 0, 1002.0), "it read everything: it ends, not a lock later"


def test_a_drain_after_a_replayed_batch_closes_as_usual_once_the_lock_has_passed():
    p, b0 = _replayed_then_read_all()
    assert p.should_run(b0, 0, 1016.0) and p.closing and not p.waiting_for_locks
    assert not p.should_run(batch(1, slots=0), 0, 1016.5)


def test_batches_far_below_the_cap_do_not_grow_it():
    """Records a broker hands out one at a time (Kafka 4.2 does so with records delivered before) make batches
    of one record, well within the lock: they say nothing of whether a bigger batch fits (on a real Kafka, 400
    of them grew the cap to 2 ** 40 times its size)."""
    p = BatchPolicy(num_slots=2, idle_probe_ms=10_000)
    slow = batch(0, [(0, 399), (0, 399)], expired=800)
    slow.acked_at = 100.0 + 40
    p.acknowledged(slow)
    assert p.lock_safe_records == 200
    for n in range(1, 4 * GROW_AFTER_BATCHES):
        b = batch(n, [(n, n)])
        b.acked_at = 100.0 + 0.1
        p.acknowledged(b)
    assert p.lock_safe_records == 200
