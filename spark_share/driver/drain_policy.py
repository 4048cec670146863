"""When an AvailableNow run (or a drain) is done: the AvailableNow half of the batch policy, in memory only.

Owns: the start's high watermarks as the target, which partitions are seen through it or answered
empty by a poll of the query's own (``unresolved``), how long a run waits for the rest and for the
records an earlier run that died may still hold locked, and when it stops (one last batch without
tasks, ``closing``). A mixin of ``policy.BatchPolicy``, which owns the state named below.

Must never: touch a socket, Kafka or Spark, wait, or lock (the tracker calls it under its lock).
"""
from __future__ import annotations

from ..errors import SourceError
from .batches import BatchState

AVAILABLE_NOW_EMPTY_RETRIES = 5
# How long an AvailableNow run that has acquired nothing yet waits for a broker that answers none of
# its polls (they run out of time: a first fetch behind a big backlog, an assignment still to come)
# before it fails saying so.
AVAILABLE_NOW_UNANSWERED_S = 120.0
# How long an AvailableNow run goes on with partitions that no poll of its own has answered (see
# ``BatchPolicy.unresolved``): the tracker closes idle consumers of the query that hold them, and
# the broker hands them to polled ones within a heartbeat (5 s by default, at most 15 s). What no
# poll of the query answers by then is held elsewhere (another member of the group): the run ends
# and says which partitions it left.
AVAILABLE_NOW_UNRESOLVED_S = 60.0

Partition = tuple[str, int]


class AvailableNowPolicy:
    # The policy's (policy.BatchPolicy sets them in its constructor).
    available_now_target: dict[Partition, int] | None
    max_seen: dict[Partition, int]
    answered: set[Partition]
    planned_any: bool
    closing: bool
    empty_streak: int
    redeliveries_due: int
    unanswered_since: float | None
    unresolved_since: float | None
    left_unread: list[Partition]
    locked_elsewhere_until: float | None
    replayed_batch: int | None
    waiting_for_locks: bool
    lock_ms: float
    carried: dict[tuple[str, str | None], int]

    @property
    def carrying(self) -> int:
        """Records sessions acquired beyond their batch and hand out later: a run is not done while any are."""
        return sum(self.carried.values())

    def start_available_now(self, high_watermarks: dict[Partition, int]) -> None:
        self.available_now_target = dict(high_watermarks)

    def seen_all(self) -> bool:
        """Has this AvailableNow run acquired every record below the start's high watermarks?"""
        target = self.available_now_target or {}
        return all(self.max_seen.get(tp, -1) >= hw - 1 for tp, hw in target.items() if hw > 0)

    def answered_empty(self, partitions) -> None:
        """A poll of ours came back empty after the broker answered a fetch for these partitions (the
        session's assignment): nothing of theirs was available to this query then."""
        self.answered.update((t, int(p)) for t, p in partitions)

    def unresolved(self) -> list[Partition]:
        """Partitions of an AvailableNow run's target with records below the start's high watermark that
        the run has neither seen nor had answered empty by a poll of its own. A partition that no
        consumer of the query polls (a member that holds its assignment but serves no read task, a
        rebalance under way, another member of the group) stays here: an empty batch is no sign that
        it is drained (issue 41: a drain ended with a partition unread, its member never polled)."""
        target = self.available_now_target or {}
        return sorted(tp for tp, hw in target.items()
                      if hw > 0 and self.max_seen.get(tp, -1) < hw - 1 and tp not in self.answered)

    def needs_acknowledgements(self, last: BatchState | None) -> bool:
        """Must the broker's answers to ``last``'s acknowledgements be in before deciding? In an
        AvailableNow run that may end here, what they gave back decides."""
        if self.available_now_target is None or not self.planned_any or self.closing:
            return False
        return not (last is not None and last.rows and not self.seen_all())

    def earlier_batch_replayed(self, batch: int, now: float) -> None:
        """Spark replays ``batch``, which an earlier run of the query planned and did not commit: that run
        stopped in the middle of it. If it died (its driver host lost), the records it held stay locked until
        their lock expires, then come back: a drain waits for them that long (``_available_now_goes_on``),
        unless that run is known to have let go of everything (``earlier_run_let_go``)."""
        self.replayed_batch = batch
        self.locked_elsewhere_until = now + self.lock_ms / 1000.0

    def earlier_run_let_go(self) -> None:
        """The run that planned the replayed batch stopped cleanly: every record it held was acknowledged
        and answered, and its consumers closed. Nothing of it is locked: no wait, and a wait begun before
        this was known (the query's id, which names that run's final counts, can come after the first
        decision: under Spark Connect with foreachBatch's commit) was for nothing locked."""
        self.locked_elsewhere_until = None
        self.waiting_for_locks = False

    def _available_now_goes_on(self, last: BatchState | None, now: float) -> bool:
        goes_on = self._available_now_decision(last, now)
        if self.locked_elsewhere_until is None or now >= self.locked_elsewhere_until:
            return goes_on
        if not goes_on or self.closing:
            # It would end, but records the earlier run held may still come back (they are below what this
            # run read: a full view of the partitions cannot tell): it goes on polling until their lock ends.
            self.closing = False
            self.waiting_for_locks = True
            return True
        return goes_on

    def _available_now_decision(self, last: BatchState | None, now: float) -> bool:
        if not self.planned_any:
            return True
        if self.closing:
            return False
        target = self.available_now_target or {}
        if last is not None and last.timed_out and not self.max_seen and any(hw > 0 for hw in target.values()):
            # Nothing acquired yet, and the broker answered none of the polls (a first fetch behind a
            # big backlog can outlast one): not an empty queue. Ending here would drain nothing of a
            # full one; go on, for AVAILABLE_NOW_UNANSWERED_S at most.
            self.unanswered_since = self.unanswered_since if self.unanswered_since is not None else now
            if now - self.unanswered_since > AVAILABLE_NOW_UNANSWERED_S:
                raise SourceError(
                    f"Trigger.AvailableNow: the broker answered none of this run's polls for "
                    f"{now - self.unanswered_since:.0f} s, with records below the start's high watermarks; "
                    "nothing was skipped (they stay in the queue). Check the broker's health, or raise "
                    "'pollTimeoutMs'")
            return True
        self.unanswered_since = None
        unresolved = self._waiting_for(now)
        if last is None or last.rows == 0:
            self.empty_streak += 1
            if unresolved:
                return True
            # Every partition is seen through its start's watermark or was answered empty: only records
            # this run gave back (or carries) are due; a few empty batches wait for them.
            due = self.redeliveries_due > 0 or self.carrying > 0
            return due and self.empty_streak <= AVAILABLE_NOW_EMPTY_RETRIES
        self.empty_streak = 0
        # Stop at once when every record below the start's watermarks has been seen (saves the empty
        # batch that would otherwise prove it), or once a batch brought only newer records and no
        # partition is still to be answered.
        if self.redeliveries_due == 0 and not self.carrying and self.seen_all():
            self.closing = True
            return True
        return (self.carrying > 0 or bool(unresolved)
                or any(lo < target.get(tp, 0) for tp, lo in last.min_offsets().items()))

    def _waiting_for(self, now: float) -> list[Partition]:
        """The unresolved partitions the run still waits for: for AVAILABLE_NOW_UNRESOLVED_S at most since
        it first found one, after which what is left is reported (``left_unread``) and the run may end."""
        unresolved = self.unresolved()
        if not unresolved:
            self.unresolved_since = None
            return []
        if self.unresolved_since is None:
            self.unresolved_since = now
        if now - self.unresolved_since <= AVAILABLE_NOW_UNRESOLVED_S:
            return unresolved
        self.left_unread = unresolved
        return []
