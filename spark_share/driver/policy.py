"""When a batch runs and how big it may be: the source's batch policy, in memory only.

Owns: whether a batch after the last one is worth running (default and processingTime triggers: it
brought records or gave some back, a session still carries records a poll acquired beyond its batch,
the high watermarks moved, or the idle probe is due; AvailableNow: ``drain_policy``), how long carried
records may wait (a fraction of the lock), how many read slots a batch gets and how many records each may take (its share of the lock budget
and of ``maxRecordsPerTrigger``, halved per consumer whenever a batch outlived the record lock; what a
batch's reads leave of its cap goes to a read that polled more: ``more``), and what it knows of the lock.

Must never: touch a socket, Kafka or Spark, wait, or lock (the tracker calls it under its lock). It
is a plain object so that it can be tested in milliseconds.
"""
from __future__ import annotations

from collections import deque

from .batches import BatchState
from .drain_policy import AvailableNowPolicy, Partition

# Kafka's default group.share.record.lock.duration.ms. The client cannot read the group's value, so
# the policy assumes this until a lock expiry shows it is shorter.
DEFAULT_LOCK_MS = 30_000
LOCK_WARN_FRACTION = 0.8
# Records a poll acquired beyond its batch's size are handed out by the session's next polls while
# they are younger than this fraction of the lock (so their batch can still commit within it); older
# ones are released at once rather than left to expire.
CARRY_FRACTION = 0.5
# After lock expiry lowered the records per consumer, this many batches in a row that held their
# records for less than this fraction of the lock double it again: one slow batch (a pause, a
# redeploy of the sink) must not leave a stream of tiny batches that can never catch up.
GROW_AFTER_BATCHES = 10
GROW_BELOW_FRACTION = 0.5
RECENT_HOLDS = 20  # batches whose hold times say the lock is at least that long
# The keepalive between tracker and agents (``dead_after_s``): half the record lock, in these bounds.
DEAD_AFTER_MIN_S = 5.0
DEAD_AFTER_MAX_S = 10.0
# Kafka's default group.share.partition.max.record.locks: records of a partition the group may have
# in flight. A batch holds its records until Spark commits it, so this caps a batch.
DEFAULT_RECORD_LOCKS = 2000
# Spark's default parallelism, which ``spark_share.register()`` passes to the driver side (classic:
# the SparkContext's environment; Spark Connect: the server's ``spark.default.parallelism``, if set).
PARALLELISM_ENV = "SPARK_SHARE_PARALLELISM"


def task_slots(parallelism: str | None) -> int | None:
    """Spark's task slots from ``PARALLELISM_ENV`` (None: not passed, or not a positive number)."""
    try:
        cores = int(parallelism) if parallelism else 0
    except ValueError:
        cores = 0
    return cores if cores > 0 else None


def default_slots(partitions: int, parallelism: str | None) -> int:
    """Read slots of a batch when ``numPartitions`` is not given: one per topic-partition (a consumer
    gains nothing from a partition of its own beyond that), at most the task slots Spark has. More
    read tasks than slots queue behind each other, each paying a task's fixed cost (a batch of 8
    tasks on 2 cores took 0.5 s where 2 took 0.28 s, on real Kafka)."""
    slots, cores = max(1, partitions), task_slots(parallelism)
    return min(slots, cores) if cores else slots


class BatchPolicy(AvailableNowPolicy):
    def __init__(self, num_slots: int, idle_probe_ms: int, max_records_per_trigger: int | None = None):
        self.num_slots = num_slots
        self.idle_probe_ms = idle_probe_ms
        self.max_records_per_trigger = max_records_per_trigger
        self.planned_any = False
        self.last_plan_time = 0.0
        self.last_plan_hw_version = -1
        # The last batch brought nothing (default and processingTime triggers): only then do the
        # watermarks decide whether a batch runs, so only then are they worth refreshing.
        self.idle = False
        self.available_now_target: dict[Partition, int] | None = None
        self.max_seen: dict[Partition, int] = {}  # highest offset acquired per partition in this run
        self.task_slots: int | None = None  # Spark's, when register() passed them
        self.empty_streak = 0
        # Records this run gave back (released, failed or expired acks) and has not seen again: an empty
        # batch does not end an AvailableNow run while some are due (a few times, as above). Counted from
        # the run's first batch: on Spark < 4.2 a drain becomes one after its first batch (user/drain.py),
        # and what that batch released is due all the same.
        self.redeliveries_due = 0
        # Records each share session acquired beyond a batch's size and hands out in a later batch: the
        # stream is not idle, nor an AvailableNow run done, while any are carried.
        self.carried: dict[tuple[str, str | None], int] = {}  # (agent, session) -> records
        self.unanswered_since: float | None = None  # time.monotonic() of the first of the polls the broker answered none of
        # AvailableNow: partitions a poll of ours found empty (see ``unresolved``), since the
        # unresolved ones were first found, and those the run gave up waiting for.
        self.answered: set[Partition] = set()
        self.unresolved_since: float | None = None
        self.left_unread: list[Partition] = []
        # AvailableNow after an earlier run died in a batch: until then its records may still be locked.
        self.locked_elsewhere_until: float | None = None
        self.replayed_batch: int | None = None
        self.waiting_for_locks = False
        # Set once an AvailableNow run has seen everything: one last batch without tasks acknowledges
        # the previous one and reports the totals in its progress, without an empty poll.
        self.closing = False
        # An AvailableNow run (or a drain) has decided that it is over: it plans no batch any more.
        self.finished = False
        # Records per slot that fit in the record lock; lowered whenever a batch's locks expire.
        self.lock_safe_records: int | None = None
        self.batches_within_lock = 0  # in a row, since the last change of lock_safe_records
        self.lock_ms = float(DEFAULT_LOCK_MS)  # the record lock duration, as far as the source knows
        self.recent_holds: deque[float] = deque(maxlen=RECENT_HOLDS)  # of batches acknowledged in full
        self.expiry_believed = True  # the last batch's INVALID_RECORD_STATE answers were lock expiries
        # The lock budget: records the group may have in flight, partitions x the broker's cap each.
        self.partitions = 1
        self.record_locks = DEFAULT_RECORD_LOCKS

    # --- should a batch run ------------------------------------------------------------------------
    def should_run(self, last: BatchState | None, hw_version: int, now: float) -> bool:
        """Is a batch after ``last`` (None: not known to this run) worth running? ``hw_version`` counts
        the changes of the high watermarks; ``now`` is ``time.monotonic()``."""
        if self.available_now_target is not None:
            goes_on = self._available_now_goes_on(last, now)
            self.finished = self.finished or (self.planned_any and not goes_on)
            return goes_on
        if not self.planned_any:
            return True
        if self.carrying or (last is not None and (last.rows or last.outcome.released or last.outcome.failed
                                                   or last.outcome.expired)):
            self.idle = False
            return True
        self.idle = True
        if hw_version != self.last_plan_hw_version:
            return True
        return now - self.last_plan_time >= self.idle_probe_ms / 1000.0

    def planned(self, hw_version: int, now: float) -> None:
        self.planned_any = True
        self.last_plan_time = now
        self.last_plan_hw_version = hw_version

    # --- slots and budgets -------------------------------------------------------------------------
    def slots_for(self, limit: int | None) -> int:
        return self.num_slots if limit is None else max(1, min(self.num_slots, limit))

    def prefetches(self, slots: int) -> bool:
        """Should a new batch of ``slots`` read tasks start its polls as soon as it is planned (one
        host), before its read tasks ask? At start-up, so that the group join overlaps Spark's
        planning; later only when its tasks queue for Spark's task slots, so that the polls of the
        tasks that wait are done when they run. Otherwise a poll answers in milliseconds, and records
        polled early are held (their lock running, the lock budget spent) while Spark writes its
        offset log and schedules the tasks, on the cores Spark needs for that. On real Kafka, 2
        cores, 2,000 locks, side by side: in flight 85 ms instead of 190-220 ms, and 93,000-99,000
        records/s after the first batch instead of 76,000-89,000. Polls started at Spark's
        ``partitions`` call (after its offset-log write) held the records 140 ms, for no gain."""
        return not self.max_seen or (self.task_slots is not None and slots > self.task_slots)

    def slots_of_new_batch(self, limit: int | None) -> int:
        """A closing AvailableNow run's last batch has no read tasks: it only acknowledges and reports."""
        return 0 if self.closing else self.slots_for(limit)

    def current_limit(self, latest: BatchState | None) -> int | None:
        """The records-per-batch limit Spark asked for last (none under ReadAllAvailable): it sizes the
        consumers' polls, so a poll never takes records the batch must give back."""
        if latest is None or latest.replay is not None:  # a replay has no limit of its own: its records are named
            return self.max_records_per_trigger
        return latest.max_records

    @property
    def lock_budget(self) -> int:
        return self.partitions * self.record_locks

    def poll_size(self, latest: BatchState | None) -> int:
        """``max.poll.records`` for a new consumer: its share of the lock budget, so that a backlog
        fills a batch up to what the broker lets the group hold (and no further: more would never
        come), and of the limit Spark asked for."""
        limit = self.current_limit(latest)
        slots = self.slots_for(limit)
        size = max(1, -(-self.lock_budget // slots))
        return size if limit is None else min(size, max(1, limit // slots))

    def slot_budgets(self, b: BatchState) -> list[int | None]:
        if b.replay is not None:  # its records are named: each slot hands out every one of them it gets
            return [None] * b.slots
        per_slot = None if b.max_records is None else max(1, b.max_records // max(1, b.slots))
        if self.lock_safe_records is not None:
            per_slot = self.lock_safe_records if per_slot is None else min(per_slot, self.lock_safe_records)
        return [per_slot] * b.slots

    def grant(self, b: BatchState, slot: int, carrying: int) -> int | None:
        """How many records the first read of ``slot`` may hand out (None: no cap).

        Kafka hands a fetch whole producer batches, so a session may hold far more than a batch may
        take; what it cannot hand out before the records grow old is released, and each release
        counts as a delivery (repeated, records reach Kafka's delivery throttle, then come one per
        fetch; at the delivery limit the broker archives them unread). So, under a batch cap
        (``maxRecordsPerTrigger``), the cap is shared out as reads claim their slots, a session that
        carries records first: its read may take what is left of the cap (at most the lock-safe
        records per consumer), and a slot claimed once the cap is spent polls nothing, so nothing new
        is acquired while carried records wait. The cap itself is never exceeded (docs/guarantees.md).
        A batch polled ahead (``prefetches``) keeps the even shares its polls started with."""
        share = self.slot_budgets(b)[0] if b.slots else None
        if b.max_records is None or b.prefetched:
            return share
        left = b.max_records - b.granted_total
        want = share or 0
        if carrying > want:
            want = carrying if self.lock_safe_records is None else min(carrying, max(want, self.lock_safe_records))
        return max(0, min(want, left))

    def more(self, b: BatchState, slot: int, want: int) -> int:
        """The read of ``slot`` polled ``want`` records beyond its grant: how many of them it may hand out now.

        A poll brings whole producer batches, so it often ends a few records past its grant; carried to the
        next batch, they were that session's whole read there (it may not poll again before they are
        acknowledged): a batch of the slot's share, then one of the few carried, over and over. And where the
        queue's records sit on the partitions of few members (the members are capped below the partitions:
        each has partitions of its own on Kafka; after a host loss one holds two), the slots whose members
        found nothing leave their share of the cap unused while the member with records takes one share.
        So the cap left over (slots not claimed yet, reads that handed out less than they were granted:
        ``unused``) goes to a read that has more, at most the lock-safe records per consumer; the cap itself
        is never exceeded. None under a batch polled ahead (its polls started with even shares) or without
        a cap."""
        if b.max_records is None or b.prefetched or want <= 0:
            return 0
        granted = b.granted.get(slot) or 0
        room = b.max_records - b.granted_total
        if self.lock_safe_records is not None:
            room = min(room, self.lock_safe_records - granted)
        extra = max(0, min(want, room))
        if extra:
            b.granted[slot] = granted + extra
            b.granted_total += extra
        return extra

    def unused(self, b: BatchState, slot: int, rows: int) -> None:
        """The read of ``slot`` handed out ``rows``: what it was granted beyond them goes back to the batch's cap
        (``more`` gives it to a read that has more)."""
        granted = b.granted.get(slot)
        if granted is not None and rows < granted:
            b.granted[slot] = rows
            b.granted_total -= granted - rows

    # --- what the batches report -------------------------------------------------------------------
    def forget_agent(self, agent: str) -> None:
        for key in [k for k in self.carried if k[0] == agent]:
            del self.carried[key]

    def acquired(self, offsets: dict[str, dict[str, list]], redelivered: int,
                 session: tuple[str, str | None] | None = None, carried: int = 0) -> None:
        """A slot acquired these offset runs (``{topic: {partition: [[first, last], ...]}}``); its
        session (agent, session id) carries ``carried`` more records for a later batch."""
        if session is not None:
            if carried:
                self.carried[session] = carried
            else:
                self.carried.pop(session, None)
        for t, parts in offsets.items():
            for p, runs in parts.items():
                k = (t, int(p))
                self.max_seen[k] = max(runs[-1][1], self.max_seen.get(k, -1))
                self.answered.discard(k)  # records came: its last answer was not empty
        self.redeliveries_due = max(0, self.redeliveries_due - redelivered)

    def acknowledged(self, b: BatchState) -> None:
        """``b``'s acknowledgements are answered: count what comes back; shrink after lock expiry,
        grow back once batches fit well within the lock again."""
        o = b.outcome
        self.redeliveries_due += o.released + o.failed + o.expired
        held = b.held_ms()
        self.expiry_believed = not (o.expired and held is not None and self.recent_holds
                                    and held <= max(self.recent_holds))
        if not self.expiry_believed:
            # A recent batch held its records longer and kept them: the lock is longer than this.
            # These were taken back for another reason (their share session ended: a member or the
            # broker went away), so neither the lock nor the batch size is lowered.
            return
        if o.expired:
            # The batch outlived the record lock: halve what one consumer may take per batch.
            if held is not None and held < self.lock_ms:
                self.lock_ms = held  # the lock is shorter than this
            biggest = max((a.get("rows", 0) for a in b.acquired.values()), default=1)
            cap = max(1, biggest // 2)
            if self.lock_safe_records is None or cap < self.lock_safe_records:
                self.lock_safe_records = cap
            self.batches_within_lock = 0
            return
        if held is not None and b.rows and not o.failed:
            self.recent_holds.append(held)
        if self.lock_safe_records is not None and b.rows:
            if held is None or held >= GROW_BELOW_FRACTION * self.lock_ms:
                self.batches_within_lock = 0
                return
            if 2 * max((a.get("rows", 0) for a in b.acquired.values()), default=0) < self.lock_safe_records:
                return  # far below the cap (records a broker hands out one at a time): no sign a bigger one fits
            self.batches_within_lock += 1
            if self.batches_within_lock >= GROW_AFTER_BATCHES:
                self.lock_safe_records *= 2
                self.batches_within_lock = 0

    @property
    def dead_after_s(self) -> float:
        """How long a connection between the tracker and an agent may stay silent before each end takes
        the other for gone (the agent then releases what it holds): within a record lock, and never so
        short that a busy host's pause ends a healthy connection."""
        return min(DEAD_AFTER_MAX_S, max(DEAD_AFTER_MIN_S, self.lock_ms / 2000.0))

    @property
    def carry_ms(self) -> float:
        return CARRY_FRACTION * self.lock_ms

    def close_to_lock(self, held_ms: float | None) -> bool:
        return held_ms is not None and held_ms > LOCK_WARN_FRACTION * self.lock_ms

    def headroom_ms(self, held_ms: float | None) -> float | None:
        return None if held_ms is None else round(self.lock_ms - held_ms, 1)
