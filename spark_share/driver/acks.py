"""Acknowledging a batch: dead letters first, then the verdicts queued on the agents, then the answers.

Owns: sending a batch's acknowledgements to the agents that acquired its records (ACCEPT, or RELEASE
for a batch that was not committed, unless a verdict says otherwise), writing its rejected records
to the dead-letter target before any REJECT, collecting the broker's answers in the background (one
thread, so batches finish in order), counting what a lost agent held as failed, and the log line
of each batch.

Must never: decide whether a batch may be ACCEPTed (the tracker does, from Spark's commits), REJECT
a record whose dead letter was not written, or wait without a bound.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from ..acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from ..options import ShareSourceOptions, scrub
from ..record_ranges import RecordRanges, RecordSorter
from ..transport.protocol import Ack, AckResult, DeadLetter, Stage, call_async
from ..verdict_set import VerdictSet
from .batches import QUEUED, BatchState
from .policy import BatchPolicy

log = logging.getLogger("spark_share.driver.tracker")

AGENT_LOST = "AGENT_LOST"  # the error a lost agent's records are counted under
ACK_TIMEOUT = "ACK_TIMEOUT"  # ... and an agent's that did not answer within ackTimeoutMs


class Acknowledger:
    def __init__(self, opts: ShareSourceOptions, policy: BatchPolicy, lock: threading.RLock,
                 agents: dict[str, Any], finished: Callable[[BatchState, int], None],
                 after: Callable[[BatchState], None] = lambda b: None):
        self.opts = opts
        self.policy = policy
        self._secrets = opts.secret_values()
        self._lock = lock
        self._agents = agents  # the tracker's live agents by id, read under ``lock``
        self._finished = finished  # called under ``lock`` once the broker answered (or did not)
        self._after = after  # then, without the lock, on the same thread: housekeeping between batches
        self.query_id: Callable[[], str | None] = lambda: None  # the query the tracker serves, once it knows
        # readMode=driver: the run's sessions sort their polls by it, so a record of a committed batch that
        # comes back because its ACCEPT came too late (its lock expired) is ACCEPTed, never emitted again.
        self.sorter: RecordSorter | None = None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-share-acks")

    def acknowledge(self, b: BatchState, default: int, queued: Callable[[], None]) -> str | None:
        """Queue ``b``'s acknowledgements on the agents that hold its records (``default`` unless a verdict
        says otherwise); ``queued`` runs under the lock once they are. Returns why the query must fail
        (a dead-letter write failed: nothing of ``b`` is acknowledged, it is all released), or None."""
        with self._lock:
            # Every agent that read a slot, records or not: an empty read is cached too (a re-read must
            # see it empty again), and this is what tells the agent it may forget it.
            conns = {a: self._agents.get(a) for a in {a["agent"] for a in b.acquired.values()}}
            verdicts = b.verdicts
            runs = b.runs_by_agent() if verdicts else {}
            accepting = _accepted_records(b, verdicts) if default == ACCEPT and self.sorter is not None else None
        timeout_s = self.opts.ack_timeout_ms / 1000.0
        failure = None
        # Each agent is sent only the verdicts on records it holds. A batch given back (not committed)
        # carries none: every record of it is RELEASEd, never REJECTed.
        empty = VerdictSet()
        per_agent = {a: verdicts.within(runs[a]) if default == ACCEPT and verdicts else empty for a in conns}
        rejects = verdicts.of_kind(REJECT) if default == ACCEPT and verdicts else empty
        if rejects and self.opts.dead_letter:
            why, written = self._write_dead_letters(b, conns, per_agent)
            # An agent REJECTs only what it wrote as a dead letter itself; a REJECT it did not write
            # becomes a RELEASE (never the default ACCEPT: the application did not take the record).
            per_agent = {a: v if a in written else v.as_kind(RELEASE, v.of_kind(REJECT)) for a, v in per_agent.items()}
            if why:
                # Nothing of this batch is acknowledged: every record comes back. The query then fails:
                # going on would cycle records towards the broker's delivery limit, which archives them.
                target = (f"deadLetterTopic={self.opts.dead_letter_topic!r}" if self.opts.dead_letter_topic
                          else f"deadLetterPath={self.opts.dead_letter_path!r}")
                log.error("spark-share batch %d: %s; its %d records are released and will be delivered again",
                          b.batch, why, b.rows)
                b.outcome.errors["DEADLETTER_WRITE_FAILED"] = len(rejects)
                failure = (f"the dead-letter target ({target}) could not be written: {why}. Nothing of "
                           f"batch {b.spark_batch if b.spark_batch is not None else b.batch} was acknowledged; "
                           "its records were released and come back when the query is restarted after the "
                           "target is fixed")
                default, per_agent = RELEASE, {a: empty for a in conns}
        # To every holder at once, without waiting for their answers: each agent queues an Ack on its
        # consumers as it arrives (on its wire loop), and the claims of the next batch are answered on
        # the same connections behind it, so they find those consumers acknowledged first. The answers
        # are collected with the broker's, off Spark's path.
        if default == ACCEPT and accepting is not None and self.sorter is not None:
            self.sorter.accepting(b.batch, accepting)
        acks = {}
        for agent_id, conn in conns.items():
            if conn is None:
                self._count_failed(b, agent_id, AGENT_LOST)
                continue
            chunks = per_agent[agent_id].chunks()
            for chunk in chunks:  # ahead of the Ack on the same connection (the agent stages them as they come)
                call_async(conn, Stage(b.batch, "ack"), chunk)
            acks[agent_id] = call_async(conn, Ack(b.batch, default, len(chunks), timeout_s))
        with self._lock:
            # Submitted before the state leaves "acking": shutdown waits for that, then stops the finisher.
            self._finisher.submit(self._collect, b, default, conns, acks, timeout_s)
            b.state = QUEUED
            queued()
        return failure

    def close(self) -> None:
        self._finisher.shutdown(wait=False)

    @staticmethod
    def _count_failed(b: BatchState, agent_id: str, why: str) -> None:
        n = b.rows_held_by(agent_id)
        if not n:
            return
        b.outcome.failed += n
        b.outcome.errors[why] = b.outcome.errors.get(why, 0) + n

    def _collect(self, b: BatchState, default: int, conns: dict, acks: dict, timeout_s: float) -> None:
        """What the agents and then the broker answered to the acknowledgements of ``b``, added to its
        outcome. An agent that did not take its Ack within ackTimeoutMs (hung, or cut off from the driver)
        costs that once: its connection is closed, so it releases what it holds when it notices, and the
        broker's lock brings the rest back."""
        wait_futures(list(acks.values()), timeout=timeout_s)
        sent = {}
        for agent_id, f in acks.items():
            if not f.done():
                log.warning("spark-share batch %d: agent %s did not queue its acknowledgements within ackTimeoutMs "
                            "(%.0f ms); it is dropped, and the %d records it holds come back when their lock "
                            "expires", b.batch, agent_id, self.opts.ack_timeout_ms, b.rows_held_by(agent_id))
                self._count_failed(b, agent_id, ACK_TIMEOUT)
                f.cancel()
                conns[agent_id].close()
                continue
            try:
                f.result(timeout=0)
                sent[agent_id] = conns[agent_id]
            except ConnectionError:  # the agent went away: the broker releases what it held
                self._count_failed(b, agent_id, AGENT_LOST)
            except Exception as e:
                self._count_failed(b, agent_id, type(e).__name__)
        futs = {a: call_async(c, AckResult(b.batch)) for a, c in sent.items()}
        wait_futures(list(futs.values()), timeout=timeout_s + 10)
        for agent_id, f in futs.items():
            try:
                rep, _ = f.result(timeout=0)
                for slot_out in rep["slots"].values():
                    b.outcome.add(AckOutcome.from_dict(slot_out))
            except Exception as e:
                self._count_failed(b, agent_id, type(e).__name__)
        if default == ACCEPT and self.sorter is not None:
            refused = b.outcome.expired + b.outcome.failed
            self.sorter.accepted(b.batch, refused=bool(refused))
            if refused:
                log.info("spark-share batch %d: Spark committed it, so its records whose ACCEPT was refused are "
                         "ACCEPTed when the broker delivers them again, never emitted again", b.batch)
        with self._lock:
            b.acked_at = time.time()
            self._finished(b, default)
        log_batch(b, self.opts.group_id, self.policy)
        try:
            self._after(b)
        except Exception:  # housekeeping must not stop the acknowledgements of later batches
            log.exception("spark-share batch %d: the work after its acknowledgement failed", b.batch)

    def _write_dead_letters(self, b: BatchState, conns: dict,
                            per_agent: dict[str, VerdictSet]) -> tuple[str | None, set[str]]:
        """Each live agent writes the rejected records it holds to the dead-letter target: every agent
        that holds one, when two do (the broker gave a lost agent's records to another in the same
        batch; only the live one's REJECT counts). An agent that is gone wrote nothing and
        acknowledges nothing: its records come back from the broker (counted failed), to be rejected
        again then. Returns (why a write failed or None, the agents that wrote theirs)."""
        held = {a: v.of_kind(REJECT) for a, v in per_agent.items()}
        futs = {}
        for agent_id, rejects in held.items():
            conn = conns.get(agent_id)
            if conn is None or not rejects:
                continue
            chunks = rejects.chunks()
            for chunk in chunks:
                call_async(conn, Stage(b.batch, "deadletter"), chunk)
            futs[agent_id] = call_async(conn, DeadLetter(b.batch, len(chunks), self.query_id()))
        written: set[str] = {a for a, rejects in held.items() if not rejects}
        for agent_id, f in futs.items():
            try:
                rep, _ = f.result(timeout=120)
            except ConnectionError:
                continue  # lost meanwhile: its acknowledgement fails too, its records come back
            except Exception as e:
                return f"writing dead letters failed on {agent_id}: {scrub(str(e), self._secrets)}", written
            if int(rep["written"]) < len(held[agent_id]):  # more: it holds a record in two slots
                return (f"only {rep['written']} of the {len(held[agent_id])} rejected records held by {agent_id} were "
                        "found to write as dead letters"), written
            written.add(agent_id)
        return None, written


def _accepted_records(b: BatchState, verdicts: VerdictSet) -> RecordRanges:
    """The records of ``b`` its acknowledgement ACCEPTs: all it acquired but those a verdict RELEASEs (they are
    to come back) or REJECTs (a failed REJECT brings its record back to be rejected again)."""
    records = RecordRanges.of_acquired(list(b.acquired.values()))
    others = {}
    for tp, part in verdicts.parts.items():
        offsets = np.sort(part.offsets[part.kinds != ACCEPT])
        if len(offsets):
            cuts = np.flatnonzero(np.diff(offsets) != 1) + 1
            others[tp] = [(int(run[0]), int(run[-1])) for run in np.split(offsets, cuts)]
    return records.minus(RecordRanges(others)) if others else records


def log_batch(b: BatchState, group_id: str, policy: BatchPolicy) -> None:
    o = b.outcome
    held = b.held_ms()
    lat = f", ack latency {1000 * (b.acked_at - b.committed_at):.0f} ms" if b.committed_at and b.acked_at else ""
    lat += f", held {held:.0f} ms" if held is not None else ""
    # A stream probing an idle queue runs a batch every idleProbeIntervalMs for weeks: those lines are
    # DEBUG, so the log grows with the records handled, not with time.
    quiet = not (b.rows or o.accepted or o.released or o.rejected or o.expired or o.failed or o.errors)
    log.log(logging.DEBUG if quiet else logging.INFO,
            "spark-share batch %d (group %s): acquired %d, accepted %d, released %d, rejected %d, "
            "expired %d, failed %d%s%s", b.batch, group_id, b.rows, o.accepted, o.released,
            o.rejected, o.expired, o.failed, lat, f", errors {o.errors}" if o.errors else "")
    if o.expired and not policy.expiry_believed:
        log.warning("spark-share batch %d: %d records were taken back after %s ms, sooner than a recent batch "
                    "kept its records (their share session ended: a member or the broker went away); they are "
                    "delivered again", b.batch, o.expired, f"{held:.0f}" if held is not None else "?")
    elif o.expired:
        log.warning("spark-share batch %d: %d records' locks expired before the batch committed; they are "
                    "delivered again. Raise the group's share.record.lock.duration.ms or lower "
                    "maxRecordsPerTrigger so batches finish within the lock; next batches take at most %d "
                    "records per consumer", b.batch, o.expired, policy.lock_safe_records)
    elif policy.close_to_lock(held):
        log.warning("spark-share batch %d held its records for %.0f ms, close to the record lock (%.0f ms "
                    "as far as spark-share knows); raise the group's share.record.lock.duration.ms or lower "
                    "maxRecordsPerTrigger before locks expire", b.batch, held, policy.lock_ms)
