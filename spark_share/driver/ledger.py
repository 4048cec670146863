"""The batches of one query run, as the driver knows them: the ledger the tracker keeps.

Owns: every ``BatchState`` of the run (made by ``plan``, or as a void replay by ``batch_to_read``),
which agent claimed and acquired each (batch, slot), the verdicts on its records, which Spark batch
ran it, how far Spark has committed (``committed_upto``), the stop flag, the waits for a batch's
acknowledgements, and the run's totals. Its lock (``lock``) also guards the tracker's agents.

Must never: talk to a socket or to Kafka, or start an acknowledgement: it marks which batches are
due (``due``, ``due_at_stop``); the tracker sends them, and only once Spark has committed.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Container

from ..acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from ..errors import BatchRefused, VerdictClash, VerdictError
from ..transport.protocol import Acquired, Claim, Verdicts
from ..verdict_set import VerdictSet
from .batches import ACKED, ACKING, FINISHED, IN_FLIGHT, PLANNED, QUEUED, RELEASED, VOID, BatchState
from .policy import BatchPolicy

log = logging.getLogger("spark_share.driver.tracker")

KEEP_FINISHED = 20  # acknowledged batches kept for status(); older ones are dropped (a stream runs for days)


class BatchLedger:
    def __init__(self, policy: BatchPolicy, max_delivery_count: int | None):
        self.policy = policy
        self.max_delivery_count = max_delivery_count
        self.lock = threading.RLock()
        self._acked = threading.Condition(self.lock)  # a batch's acknowledgement moved on
        self.batches: dict[int, BatchState] = {}
        # Spark has committed every batch up to here (it said so through latestOffset, commit or the
        # listener): the one fact that lets a batch be ACCEPTed, recorded before anything acts on it.
        self.committed_upto = -1
        self.stopping = False  # set once by the stop: nothing new is planned, claimed or acknowledged
        self.totals = AckOutcome()
        self.total_acquired = 0
        self.replay_missing = 0  # records replayed batches named that the broker no longer held for this query
        self._staged: dict[str, tuple[int, list[bytes]]] = {}  # verdict token -> (batch, its chunks so far)

    def latest(self) -> BatchState | None:
        with self.lock:
            return self.batches[max(self.batches)] if self.batches else None

    # planning -----------------------------------------------------------------------------
    def plan(self, batch: int, max_records: int | None, version: int) -> tuple[BatchState | None, bool]:
        """``batch`` and whether this call made it; (None, False) once the query is stopping."""
        with self.lock:
            if self.stopping:
                return None, False
            old = self.batches.get(batch)
            b = old or BatchState(batch, self.policy.slots_of_new_batch(max_records), max_records)
            self.batches[batch] = b
            self.policy.planned(version, time.monotonic())
        return b, old is None

    def replay(self, batch: int, wanted: int) -> BatchState | None:
        """``batch``, planned by an earlier run, to be read again with the ``wanted`` records its offset names
        (readMode=driver); None once the query is stopping."""
        with self.lock:
            if self.stopping:
                return None
            b = self.batches.get(batch)
            if b is None:
                b = self.batches[batch] = BatchState(batch, self.policy.slots_for(None), None,
                                                     replay={"wanted": wanted, "missing": None})
            return b if b.state == PLANNED else None

    def batch_to_read(self, batch: int) -> BatchState | None:
        """The batch Spark wants read tasks for, or None when it must read nothing: a batch this run did
        not plan (after a restart Spark replays the last batch of the earlier run, whose records were
        released: new records under its id would be ACCEPTed although an idempotent sink skips the
        replayed id), or any batch once the query is stopping."""
        with self.lock:
            b = self.batches.get(batch)
            if b is None:
                b = self.batches[batch] = BatchState(batch, 0, None, state=VOID)
                self.policy.earlier_batch_replayed(batch, time.monotonic())
                log.warning("spark-share batch %d was planned by an earlier run of this query: Spark replays it, "
                            "and it reads nothing (the records that run held were released, or, if it died, come "
                            "back when their lock expires: a drain waits that long for them, unless that run "
                            "stopped cleanly on this host; they come back in later batches)", batch)
            if self.stopping or b.state != PLANNED:
                return None
            return b

    # what the agents report ---------------------------------------------------------------
    def claim(self, m: Claim, agent_id: str, live_agents: Container[str]) -> str | None:
        """Which agent reads (batch, slot): the one that acquired it (every re-read gets the same rows),
        else the asking one, which polls. None: the slot's records were acquired by an agent that is
        gone; its rows may already be in a sink, so the slot reads nothing rather than new records
        under the same batch id (the lost ones are released by the broker and come back)."""
        with self.lock:
            b = self.batches.get(m.batch)
            if self.stopping or b is None or b.state != PLANNED:
                raise BatchRefused(self._refusal(m.batch, b))
            if m.spark_batch is not None:
                b.spark_batch = int(m.spark_batch)
            if m.connect_session:
                b.connect_sessions.add(m.connect_session)
            owner = b.claims.get(m.slot)
            if owner is not None and owner not in live_agents:
                if m.slot in b.acquired:
                    log.warning("batch %d slot %d: agent %s that acquired it is gone; this read gets no rows (its "
                                "records are released by the broker and come back in a later batch)",
                                m.batch, m.slot, owner)
                    return None
                owner = None  # claimed but never acquired: no row of it reached Spark
            if owner is None:
                b.claims[m.slot] = owner = agent_id
                granted = b.granted[m.slot] = self.policy.grant(b, m.slot, m.carrying)
                b.granted_total += granted or 0
            return owner

    def reassign(self, batch: int, slot: int, agent_id: str) -> bool:
        """(batch, slot), claimed and not acquired, is read by ``agent_id`` instead (a read lent to another
        host at the members' cap). Call with ``lock`` held."""
        b = self.batches.get(batch)
        if b is None or b.state != PLANNED or slot in b.acquired:
            return False
        b.claims[slot] = agent_id
        return True

    def more(self, batch: int, slot: int, want: int, agent_id: str) -> int:
        """How many of the ``want`` records the read of (batch, slot) polled beyond its grant it may hand out
        (``BatchPolicy.more``): 0 unless ``agent_id`` is the slot's reader and the batch is still being read."""
        with self.lock:
            b = self.batches.get(batch)
            if self.stopping or b is None or b.state != PLANNED or b.claims.get(slot) != agent_id or slot in b.acquired:
                return 0
            return self.policy.more(b, slot, want)

    def granted(self, batch: int, slot: int) -> int | None:
        with self.lock:
            return self.batches[batch].granted.get(slot)

    def _refusal(self, batch: int, b: BatchState | None) -> str:
        """Why a read of ``batch`` may acquire nothing. Call with ``lock`` held."""
        if self.stopping:
            return f"kafka-share batch {batch} cannot be read: the query is stopping"
        if b is not None and b.state == VOID:
            return (f"kafka-share batch {batch} was planned by an earlier run of this query; it reads nothing "
                    "(the records that run held were released and come back in later batches)")
        if b is None and (not self.batches or batch > max(self.batches)):
            return f"kafka-share batch {batch} was never planned by this run of the query; it cannot be read"
        return (f"kafka-share batch {batch} is already committed and its records acknowledged, so it cannot be "
                "read again: an action on a batch DataFrame after its foreachBatch call returned (or a task "
                "attempt that outlived its stage) has no records to read. Keep what you need inside "
                "foreachBatch (persist() or collect the rows there)")

    def acquired(self, m: Acquired, agent_id: str) -> None:
        """What an agent's poll for (batch, slot) acquired; records at the delivery limit are rejected."""
        with self.lock:
            b = self.batches[m.batch]
            b.acquired[m.slot] = {"agent": agent_id, "session": m.session, "rows": m.rows,
                                  "acquired_at": m.acquired_at, "offsets": m.offsets, "timed_out": m.timed_out,
                                  "reported_at": time.time(), "convert_ms": m.convert_ms}
            self.policy.acquired(m.offsets, m.redelivered, (agent_id, m.session), m.carried)
            self.policy.unused(b, m.slot, m.rows)
            self.policy.answered_empty(m.answered)
            limit = self.max_delivery_count
            if m.poison:
                b.verdicts.update(VerdictSet.from_records(
                    [(t, p, o, REJECT, f"deliveryCount {count} reached maxDeliveryCount {limit}")
                     for t, p, o, count in m.poison]))
            if m.poison:
                log.warning("batch %d: %d records reached maxDeliveryCount %s; they are rejected to the dead-letter "
                            "target instead of being processed again", m.batch, len(m.poison), limit)
            self.total_acquired += m.rows

    def record_verdicts(self, m: Verdicts, blob, ours: bool = True) -> dict:
        """Record reject/release verdicts for a running batch: the chunks of one call are staged until its
        last, then applied all or nothing (every row must be one the batch acquired, none may already have
        the other kind). O(rows): numpy arrays, searched per partition, never a Python object per row."""
        kind = {"reject": REJECT, "release": RELEASE}[m.kind]
        with self.lock:
            if m.part == 0:
                b = self._verdict_batch(m, blob, ours)
                if b is None:
                    return {"match": False}
                self._staged[m.token] = (b.batch, [])
            staged = self._staged.get(m.token)
            if staged is None:
                raise VerdictError(f"verdicts {m.token}: part {m.part} of {m.parts} came without the first")
            staged[1].append(bytes(blob))
            if m.part < m.parts - 1:
                return {"ok": True, "match": True, "staged": len(staged[1])}
            del self._staged[m.token]
            b = self.batches.get(staged[0])
            if b is None or b.state != PLANNED:
                raise VerdictError(f"batch {m.spark_batch} is no longer being processed; its verdicts were not recorded")
            batch = b.spark_batch if b.spark_batch is not None else b.batch
            runs = list(b.runs_by_agent().values())
        # Decoding and checking millions of rows happens without the lock (the batch's acquisitions are
        # all in: foreachBatch runs after its read tasks); only the update takes it again.
        try:
            given = VerdictSet.from_chunks(staged[1])
        except VerdictClash as e:
            raise VerdictError(f"{e.count} rows are named with both verdicts in one call, e.g. "
                               + ", ".join(f"{t}-{p}@{o}" for t, p, o in e.rows)) from None
        if any((part.kinds != kind).any() for part in given.parts.values()):
            raise VerdictError(f"verdicts of a {m.kind}() call arrived with other kinds")
        foreign, examples = given.outside(runs)
        if foreign:
            raise VerdictError(f"{foreign} of {len(given)} rows are not from batch {batch} of this query, "
                               "e.g. " + ", ".join(f"{t}-{p}@{o}" for t, p, o in examples))
        with self.lock:
            try:
                b.verdicts.update(given)
            except VerdictClash as e:
                raise VerdictError(f"{e.count} rows were already given the opposite verdict (a row cannot be both "
                                   "rejected and released), e.g. "
                                   + ", ".join(f"{t}-{p}@{o}" for t, p, o in e.rows)) from None
        return {"ok": True, "match": True, "records": len(given)}

    def _verdict_batch(self, m: Verdicts, first_chunk, ours: bool) -> BatchState | None:
        """The batch verdicts name: Spark's batch id (classic), or under Spark Connect the latest batch read
        in that session (None: not ours). A batch whose Spark id no read task reported (readMode=driver:
        its reads never reach the tracker) is the running one, if the verdicts are ``ours`` (sent to this
        query's tracker) or its rows hold the first chunk's; it takes the verdicts' Spark id from then on.
        Call with ``lock`` held."""
        if m.connect_session:
            b = max((b for b in self.batches.values()
                     if m.connect_session in b.connect_sessions and b.state == PLANNED),
                    key=lambda b: b.batch, default=None)
            if b is None:  # no read task named the session: the running batch, if it holds the rows
                b = self._unnamed_running(first_chunk, check_rows=True)
                if b is not None:
                    b.connect_sessions.add(m.connect_session)
            return b
        b = next((b for b in self.batches.values() if b.spark_batch == m.spark_batch), None)
        if b is None:
            b = self._unnamed_running(first_chunk, check_rows=not ours)
            if b is not None:
                b.spark_batch = m.spark_batch
        if b is None and not ours:  # asked as one of this host's trackers: not this query's
            return None
        if b is None or b.state != PLANNED:
            raise VerdictError(f"batch {m.spark_batch} has no kafka-share records being processed in this "
                               f"query (state: {b.state if b else 'nothing read'}); verdicts apply to rows "
                               "of the batch being processed in foreachBatch")
        return b

    def _unnamed_running(self, first_chunk, check_rows: bool) -> BatchState | None:
        """The running batch no read task named to Spark's batch or a Connect session (readMode=driver), if
        any (and, ``check_rows``, if it acquired every row of ``first_chunk``). Call with ``lock`` held."""
        running = max((b for b in self.batches.values()
                       if b.state == PLANNED and b.spark_batch is None and not b.connect_sessions),
                      key=lambda b: b.batch, default=None)
        if running is None or not check_rows:
            return running
        foreign, _ = VerdictSet.from_chunks([first_chunk]).outside(list(running.runs_by_agent().values()))
        return None if foreign else running

    def source_batch_of(self, spark_batch: int) -> int | None:
        """Our batch that Spark ran as ``spark_batch`` or, if that one read nothing of ours, the
        last one before it."""
        with self.lock:
            mapped = [n for n, b in self.batches.items() if b.spark_batch is not None and b.spark_batch <= spark_batch]
        return max(mapped) if mapped else None

    # acknowledgements ---------------------------------------------------------------------
    def due(self, upto: int) -> list[BatchState]:
        """Spark has committed every batch <= ``upto``: the ones not yet being acknowledged, now marked so."""
        with self.lock:
            self.committed_upto = max(self.committed_upto, upto)
            if self.stopping:  # the stop acknowledges what is left, knowing it was committed
                return []
            todo = [b for n, b in sorted(self.batches.items()) if n <= upto and b.state == PLANNED]
            for b in todo:
                b.state = ACKING
                b.committed_at = time.time()
        return todo

    def due_at_stop(self) -> list[BatchState] | None:
        """Set ``stopping``; the batches still held, now marked as being acknowledged; None if a stop
        had already begun."""
        with self.lock:
            if self.stopping:
                return None
            self.stopping = True
            pending = [b for _, b in sorted(self.batches.items()) if b.state == PLANNED]
            for b in pending:
                b.state = ACKING
        return pending

    def committed(self, b: BatchState, commit_log, run: str | None = None) -> bool:
        """Did Spark commit ``b`` (it said so, or its commit log shows it: under Spark's id of it, or, when no
        read task reported that id, the one whose offsets carry ``run``'s offset of ``b``)?"""
        if b.batch <= self.committed_upto or not commit_log:
            return b.batch <= self.committed_upto
        spark_batch = b.spark_batch if b.spark_batch is not None or run is None else commit_log.spark_batch_of(run, b.batch)
        return commit_log.has(spark_batch)

    def notify(self) -> None:
        with self.lock:
            self._acked.notify_all()

    def wait_acked(self, upto: int, pending=(ACKING, QUEUED), timeout: float = 35.0) -> None:
        """Until no batch <= ``upto`` is in a ``pending`` state, for ``timeout`` at most."""
        with self._acked:
            self._acked.wait_for(lambda: all(b.state not in pending for n, b in self.batches.items() if n <= upto),
                                 timeout=timeout)

    def finished(self, b: BatchState, default: int) -> None:
        """The broker answered ``b``'s acknowledgements (called by the acknowledger)."""
        with self.lock:
            b.state = ACKED if default == ACCEPT else RELEASED
            self.totals.add(b.outcome)
            self.policy.acknowledged(b)
            done = sorted(n for n, x in self.batches.items() if x.state in FINISHED)
            for n in done[:-KEEP_FINISHED]:
                del self.batches[n]
            for n in done[-KEEP_FINISHED:-2]:  # the last two stay whole: the policy reads the latest's offsets
                self.batches[n].slim()
            self._acked.notify_all()

    # what progress and status() show -----------------------------------------------------------
    def held(self) -> list[dict]:
        """What each in-flight batch's slots acquired (for the backlog estimate)."""
        with self.lock:
            return [a for b in self.batches.values() if b.state in IN_FLIGHT for a in b.acquired.values()]

    def progress(self) -> dict:
        with self.lock:
            done = [b for b in self.batches.values() if b.state in (ACKED, RELEASED)]
            t = self.totals
            return {"batch": max(self.batches) if self.batches else None,
                    "inflightRecords": sum(b.rows for b in self.batches.values() if b.state in IN_FLIGHT),
                    "lastAcked": max(done, key=lambda b: b.batch).summary() if done else None,
                    "acquired": self.total_acquired, "accepted": t.accepted, "released": t.released,
                    "rejected": t.rejected, "expired": t.expired, "failed": t.failed,
                    **({"replayMissing": self.replay_missing} if self.replay_missing else {})}

    def status(self) -> dict:
        """The last batches, the sessions that acquired records, and the claims of the last batch read."""
        with self.lock:
            read = [b for _, b in sorted(self.batches.items()) if b.claims]
            return {"batches": [b.summary() for _, b in sorted(self.batches.items())[-20:]],
                    "sessions": sorted({a.get("session") for b in self.batches.values() for a in b.acquired.values()
                                        if a.get("session")}),
                    "claims": list(read[-1].claims.values()) if read else []}
