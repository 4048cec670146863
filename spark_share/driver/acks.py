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

from ..acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from ..options import ShareSourceOptions, scrub
from ..transport.protocol import Ack, AckResult, DeadLetter, call_async
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
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-share-acks")

    def acknowledge(self, b: BatchState, default: int, queued: Callable[[], None]) -> str | None:
        """Queue ``b``'s acknowledgements on the agents that hold its records (``default`` unless a verdict
        says otherwise); ``queued`` runs under the lock once they are. Returns why the query must fail
        (a dead-letter write failed: nothing of ``b`` is acknowledged, it is all released), or None."""
        with self._lock:
            # Every agent that read a slot, records or not: an empty read is cached too (a re-read must
            # see it empty again), and this is what tells the agent it may forget it.
            holders = {a["agent"] for a in b.acquired.values()}
            conns = {a: self._agents.get(a) for a in holders}
            verdicts = [[t, p, o, k] for (t, p, o), (k, _) in b.verdicts.items()]
            rejects = [[t, p, o, r] for (t, p, o), (k, r) in b.verdicts.items() if k == REJECT]
        timeout_s = self.opts.ack_timeout_ms / 1000.0
        failure = None
        # A batch given back (not committed) carries no verdict: every record of it is RELEASEd, never REJECTed.
        per_agent = {a: verdicts if default == ACCEPT else [] for a in conns}
        if default == ACCEPT and rejects and self.opts.dead_letter:
            why, written = self._write_dead_letters(b, conns, rejects)
            # An agent REJECTs only what it wrote as a dead letter itself; a REJECT it did not write
            # becomes a RELEASE (never the default ACCEPT: the application did not take the record).
            per_agent = {a: [v if v[3] != REJECT or (v[0], v[1], v[2]) in written.get(a, set())
                             else [v[0], v[1], v[2], RELEASE] for v in verdicts] for a in conns}
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
                default, per_agent = RELEASE, {a: [] for a in conns}
        sent = {}
        # To every holder at once; each answers once it has queued the acknowledgement on its consumers,
        # ahead of any later poll of them (the broker's answers are collected off Spark's path). An agent
        # that does not answer within ackTimeoutMs (hung, or cut off) costs that once: its connection is
        # closed, so it releases what it holds when it notices, and the broker's lock covers the rest.
        futs = {}
        for agent_id, conn in conns.items():
            if conn is None:
                self._count_failed(b, agent_id, AGENT_LOST)
                continue
            futs[agent_id] = call_async(conn, Ack(b.batch, default, per_agent[agent_id], timeout_s))
        wait_futures(list(futs.values()), timeout=timeout_s)
        for agent_id, f in futs.items():
            if not f.done():
                log.warning("spark-share batch %d: agent %s did not queue its acknowledgements within ackTimeoutMs "
                            "(%.0f ms); it is dropped, and the %d records it holds come back when their lock "
                            "expires", b.batch, agent_id, self.opts.ack_timeout_ms, b.rows_held_by(agent_id))
                self._count_failed(b, agent_id, ACK_TIMEOUT)
                f.cancel()
                conns[agent_id].close()  # type: ignore[union-attr]  # only live ones were asked
                continue
            try:
                f.result(timeout=0)
                sent[agent_id] = conns[agent_id]
            except ConnectionError:  # the agent went away: the broker releases what it held
                self._count_failed(b, agent_id, AGENT_LOST)
            except Exception as e:
                self._count_failed(b, agent_id, type(e).__name__)
        with self._lock:
            # Submitted before the state leaves "acking": shutdown waits for that, then stops the finisher.
            self._finisher.submit(self._collect, b, default, sent, timeout_s)
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

    def _collect(self, b: BatchState, default: int, sent: dict, timeout_s: float) -> None:
        """What the broker answered to the acknowledgements of ``b``, added to its outcome."""
        futs = {a: call_async(c, AckResult(b.batch)) for a, c in sent.items()}
        wait_futures(list(futs.values()), timeout=timeout_s + 10)
        for agent_id, f in futs.items():
            try:
                rep, _ = f.result(timeout=0)
                for slot_out in rep["slots"].values():
                    b.outcome.add(AckOutcome.from_dict(slot_out))
            except Exception as e:
                self._count_failed(b, agent_id, type(e).__name__)
        with self._lock:
            b.acked_at = time.time()
            self._finished(b, default)
        log_batch(b, self.opts.group_id, self.policy)
        try:
            self._after(b)
        except Exception:  # housekeeping must not stop the acknowledgements of later batches
            log.exception("spark-share batch %d: the work after its acknowledgement failed", b.batch)

    def _write_dead_letters(self, b: BatchState, conns: dict,
                            rejects: list[list]) -> tuple[str | None, dict[str, set[tuple[str, int, int]]]]:
        """Each live agent writes the rejected records it holds to the dead-letter target: every agent
        that holds one, when two do (the broker gave a lost agent's records to another in the same
        batch; only the live one's REJECT counts). An agent that is gone wrote nothing and
        acknowledges nothing: its records come back from the broker (counted failed), to be rejected
        again then. Returns (why a write failed or None, agent -> the records it wrote)."""
        held: dict[str, list] = {}
        with self._lock:
            for r in rejects:
                for agent_id in b.holders(r[0], int(r[1]), int(r[2])):
                    held.setdefault(agent_id, []).append(r)
        futs = {a: call_async(conns[a], DeadLetter(b.batch, mine)) for a, mine in held.items()
                if conns.get(a) is not None}
        written: dict[str, set[tuple[str, int, int]]] = {}
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
            written[agent_id] = {(t, int(p), int(o)) for t, p, o, _ in held[agent_id]}
        return None, written


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
