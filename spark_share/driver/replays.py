"""What the tracker does for a batch Spark runs again after a restart (readMode=driver): the batch made from the
records its offset names, what of them did not come back, and what this host knows of the run that planned it.

A mixin of ``tracker.Tracker``, which owns the state named below. Must never: replace a record the replay did
not get by another, or talk to Kafka (``driver.reads`` polls).
"""
from __future__ import annotations

import logging

from .. import runtime
from ..options import ShareSourceOptions
from ..record_ranges import RecordRanges
from .batches import BatchState
from .ledger import BatchLedger

log = logging.getLogger("spark_share.driver.tracker")


def _run_end(run: str) -> dict:
    """What query run ``run`` of this host said when it stopped (``runtime.run_end_path``)."""
    return runtime.read_json(runtime.run_end_path(run)) or {}




class TrackerReplays:
    # The tracker's, set in its constructor.
    opts: ShareSourceOptions
    ledger: BatchLedger

    def replay(self, batch: int, wanted: RecordRanges) -> BatchState | None:
        """Batch ``batch`` of an earlier run, read again with the records its offset names (readMode=driver)."""
        b = self.ledger.replay(batch, len(wanted))
        if b is not None:
            log.info("spark-share batch %d was planned by an earlier run of this query: Spark runs it again, and it "
                     "reads the %d records its offset names (%s), nothing else", batch, len(wanted), wanted.described())
        return b

    def replayed(self, b: BatchState, wanted: RecordRanges) -> None:
        """A replayed batch's reads are done: what of its records the broker no longer held for this query is
        counted and said (never replaced by other records)."""
        missing = wanted.minus(self.records_of(b))
        with self.ledger.lock:
            b.replay = {"wanted": len(wanted), "missing": len(missing)}
            self.ledger.replay_missing += len(missing)
        if missing:
            log.warning("spark-share batch %d, run again: %d of its %d records were not delivered to this query again "
                        "(another member of share group %r took them, or the broker archived them at the delivery "
                        "limit): %s. The batch carries the other %d; none is replaced", b.batch, len(missing),
                        len(wanted), self.opts.group_id, missing.described(), len(wanted) - len(missing))

    def records_of(self, b: BatchState) -> RecordRanges:
        with self.ledger.lock:
            return RecordRanges.of_acquired(list(b.acquired.values()))

    @staticmethod
    def earlier_run(run: str | None) -> str:
        """What this host knows of query run ``run``: "running" (its tracker is still stopping), "closed" (it
        stopped and closed its consumers), else "unknown" (lost, or on another host)."""
        if not run or not runtime.SAFE_ID.fullmatch(str(run)):
            return "unknown"
        if runtime.tracker_alive(run):
            return "running"
        return "closed" if _run_end(run).get("consumersClosed") else "unknown"

    @staticmethod
    def released_after_commit(run: str | None, batch: int) -> bool:
        """Did run ``run`` (of this host) give back batch ``batch`` although Spark committed it (its dead letters
        could not be written)? Then its records must come back to be processed, verdicts and all."""
        return bool(run) and runtime.SAFE_ID.fullmatch(str(run)) is not None and batch in _run_end(str(run)).get(
            "releasedCommitted", [])

