"""The driver-side tracker: one query run's batches, agents and acknowledgements, and its stop.

Lives in the reader's runner process (``python_streaming_source_runner``), started lazily by
the reader. Owns: the per-query secret, the TCP server agents and the user's process connect
to (what it answers them is ``requests``'), acknowledging a batch once Spark committed it, and the
stop; the progress it reports is ``reports``', a batch run again after a restart ``replays``'. It keeps the batches in the ledger
(``ledger``), the agents in the roster (``roster``), and the registry entries through which the
user's process (foreachBatch, the listener) finds it in ``registration``; it asks the policy
(``policy``) whether a batch runs and how big, the watermark thread (``watermarks``) whether
records arrived, and the acknowledger (``acks``) to send a batch's verdicts to the agents.

Must never: acknowledge a batch before Spark has committed it (only ``batch_committed`` starts an
ACCEPT, and it is called from ``latestOffset`` or the commit listener), talk to Kafka on the
``latestOffset`` path (the metadata thread keeps watermarks in memory), return from
``latestOffset`` before the previous batch's acknowledgements are queued ahead of the next polls,
send a client credential to an agent, or write a secret to a log, an offset or a progress report.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import wait as wait_futures

from .. import runtime
from ..acknowledgement import ACCEPT, RELEASE
from ..deadletter_target import check_target
from ..errors import SourceError
from ..options import ShareSourceOptions, scrub
from ..record_ranges import RecordSorter
from ..spark_versions import available_now_refusal
from ..transport import wire
from ..transport.protocol import USER_TO_TRACKER_BY_FILE, Trim, call_async, dispatcher
from .acks import AGENT_LOST, Acknowledger
from .agents import AgentRoster, one_host
from .batches import ACKING, FINISHED, VOID, BatchState
from .commitlog import CommitLog
from .drain_policy import AVAILABLE_NOW_UNRESOLVED_S
from .ledger import BatchLedger
from .members import IDLE_BATCHES, MemberBook
from .policy import DEFAULT_RECORD_LOCKS, PARALLELISM_ENV, BatchPolicy, default_slots, task_slots
from .registration import Registration
from .replays import TrackerReplays
from .reports import TrackerReports
from .requests import TrackerRequests
from .watermarks import MetadataWatcher

log = logging.getLogger("spark_share.driver.tracker")

__all__ = ["Tracker", "AGENT_LOST", "one_host"]

TRIM_TIMEOUT_S = 15.0  # an agent asked to close idle members answers within this
SHUTDOWN_WAIT_S = 10.0  # a stop waits this long at most for acknowledgements under way, then for agents


def _bind_host(read_mode: str) -> str:
    """The narrowest interface executors can reach: loopback in local mode and with readMode=driver (only
    processes of the driver host connect), else the address they already reach the driver on.
    ``register()`` passes the master and driver host to this process through the SparkContext's
    environment; SPARK_SHARE_BIND_HOST overrides."""
    explicit = os.environ.get("SPARK_SHARE_BIND_HOST")
    if explicit:
        return explicit
    if read_mode != "driver" and not one_host():
        return (os.environ.get("SPARK_SHARE_DRIVER_HOST") or os.environ.get("SPARK_LOCAL_IP")
                or socket.gethostbyname(socket.gethostname()))
    return "127.0.0.1"


class Tracker(TrackerRequests, TrackerReports, TrackerReplays):
    def __init__(self, opts: ShareSourceOptions):
        self.opts = opts
        self.tracker_id = uuid.uuid4().hex[:16]
        self.secret = wire.new_secret()
        self._secrets = opts.secret_values()
        self.failure: str | None = None  # why the query must stop (set once, raised by latestOffset)
        # Why this query's reads are refused before they acquire anything (a trigger this Spark cannot run).
        self.refusal: str | None = None
        self._drain_decided = -2  # the batch after which a drain last decided whether it goes on
        self._left_reported = False  # a drain that ended with partitions unanswered said so
        self._drain_trimmed = -1  # the last empty batch after which a drain closed unpolled consumers
        self._earlier_run_checked = False  # a replayed batch's run looked up in its final counts
        self.session_ms: int | None = None  # the group's session timeout, where the cluster says
        self.released_committed: set[int] = set()  # committed batches given back (their dead letters failed)
        self.sorter: RecordSorter | None = None  # readMode=driver: what the run's sessions sort polls by
        self.commit_log: CommitLog | None = None  # Spark's commit log of the query, once the listener noted it
        # Created before the watcher, whose thread asks it whether the stream is idle; the slots are
        # known once the watcher has listed the partitions.
        self.policy = BatchPolicy(opts.num_partitions or 1, opts.idle_probe_ms, opts.max_records_per_trigger)
        self.ledger = BatchLedger(self.policy, opts.max_delivery_count)
        self.roster = AgentRoster(opts, self.policy, self.ledger.lock)
        self.agents = self.roster.conns  # agent id -> its connection
        self.backlog: dict = {}  # the last estimate (backlog.py), refreshed by the watermark thread
        self._backlog_logged = 0.0
        runtime.prune()
        self._alive_fd = runtime.hold_tracker_lock(self.tracker_id)
        self._log_file = runtime.log_to_file(runtime.tracker_log_path(self.tracker_id))
        try:
            self.metadata = MetadataWatcher(opts, wanted=lambda: self.policy.idle, on_refresh=self._estimate_backlog)
        except BaseException:
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
            raise
        try:
            check_target(opts, self.metadata.client)
            # No agent knows the address before this constructor returns: nothing is served early.
            self.server = self._listen(_bind_host(opts.read_mode))
        except BaseException:
            self.metadata.close()
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
            raise
        self.address = self.server.address
        # What was queued when this run started: what spark_share.drain() drains where Spark has no
        # Trigger.AvailableNow for a Python source (< 4.2).
        self.start_high = dict(self.metadata.high)
        # foreachBatch under Spark Connect and the listener on the server find the tracker by its id (its
        # query id is not known yet); user code that shares nothing with this host, by its exchangeLocation.
        try:
            self.registration = Registration(
                self.tracker_id, {"host": self.address[0], "port": self.address[1], "secret": self.secret,
                                  "tracker_id": self.tracker_id, "pid": os.getpid()},
                opts.exchange_location, dispatcher(self, USER_TO_TRACKER_BY_FILE), lambda s: scrub(s, self._secrets))
            self._size_batches()
        except BaseException:
            self.server.close()
            self.metadata.close()
            if hasattr(self, "registration"):
                self.registration.remove()
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
            raise
        # At most numPartitions members at any time, whichever hosts Spark reads on (driver/members.py).
        self.members = self.roster.members = MemberBook(self.policy.num_slots)
        self.acks = Acknowledger(opts, self.policy, self.ledger.lock, self.agents, self.ledger.finished,
                                 after=self._after_batch)
        self.acks.query_id = lambda: self.query_id
        self._stopped = threading.Event()

    def _size_batches(self) -> None:
        """Slots from the partitions, and the lock budget and duration from the options or the broker."""
        opts, partitions = self.opts, len(self.metadata.partitions)
        parallelism = os.environ.get(PARALLELISM_ENV)
        broker_locks, lock_ms, max_members, session_ms, group_locks = self.metadata.share_limits()
        slots = default_slots(partitions, parallelism)
        if max_members is not None:
            if opts.num_partitions is not None and opts.num_partitions > max_members:
                raise SourceError(f"option 'numPartitions' = {opts.num_partitions} asks for {opts.num_partitions} share "
                                  f"consumers, but the broker's group.share.max.size lets share group "
                                  f"{opts.group_id!r} have {max_members} members at most: lower numPartitions to "
                                  f"{max_members} or less (other consumers of the group count too), or raise "
                                  "group.share.max.size on the brokers")
            slots = min(slots, max_members)  # the default stays within the group's limit
        self.policy.num_slots = opts.num_partitions or slots
        self.policy.task_slots = task_slots(parallelism)
        self.policy.partitions = max(1, partitions)
        if lock_ms is not None:
            self.policy.lock_ms = float(lock_ms)
        self.session_ms = session_ms
        locks, said = opts.max_record_locks, "option maxRecordLocks"
        if locks is None:
            locks, said = broker_locks, ("the group's share.partition.max.record.locks" if group_locks
                                         else "the broker's group.share.partition.max.record.locks")
        if locks is None:
            locks, said = DEFAULT_RECORD_LOCKS, "Kafka's default (the broker did not say; set maxRecordLocks)"
        self.policy.record_locks = locks
        log.info("spark-share tracker %s for group %r, topics %s (%d partitions), %d slots, listening on %s:%d",
                 self.tracker_id, opts.group_id, list(opts.topics), partitions, self.policy.num_slots, *self.address)
        log.info("record locks per partition: %d, from %s: the group may hold about %d records at once, so a "
                 "batch reaches about that many (%d per consumer's poll; the broker hands out whole producer batches, "
                 "so a batch can pass it by up to one of those per partition). A record stays locked until Spark "
                 "commits its batch, so the query reads at most that many records per batch's time; raise it for "
                 "this group with kafka-configs.sh --entity-type groups --entity-name %s --alter --add-config "
                 "share.partition.max.record.locks=N (Kafka 4.3+; at most the brokers' "
                 "group.share.max.partition.max.record.locks, 4000 by default), or on the brokers",
                 locks, said, self.policy.lock_budget, self.policy.poll_size(None), opts.group_id)
        log.info("record lock duration: %.0f ms, %s", self.policy.lock_ms,
                 "the group's share.record.lock.duration.ms" if lock_ms is not None
                 else "Kafka's default (the broker did not say)")

    @property
    def batches(self) -> dict[int, BatchState]:
        return self.ledger.batches

    @property
    def total_acquired(self) -> int:
        return self.ledger.total_acquired

    @property
    def query_id(self) -> str | None:
        return self.registration.query_id

    def _serve_query(self, query_id: str | None) -> None:
        if self.registration.serve(query_id):
            self._learn_commit_log()

    def _learn_commit_log(self) -> None:
        if self.commit_log is None and self.query_id is None and self.opts.read_mode == "driver":
            found = CommitLog.of_run(self.tracker_id)  # no read task told this run its query: its offsets do
            if found is not None:
                self._serve_query(found[0])
        if self.commit_log is None and self.query_id is not None:
            self.commit_log = CommitLog.of_query(self.query_id)
            if self.commit_log is not None and not self.refusal:
                self.refusal = available_now_refusal(self.commit_log.trigger)
                if self.refusal:
                    log.error("spark-share: %s", self.refusal)

    # planning -----------------------------------------------------------------------------
    def prepare_available_now(self) -> None:
        self.metadata.refresh()
        self.policy.start_available_now(self.metadata.complete_high())

    def should_run(self, last_batch: int) -> bool:
        """Is a batch after ``last_batch`` worth running? Answers from memory (see ``policy``)."""
        with self.ledger.lock:
            wait = self.policy.needs_acknowledgements(self.batches.get(last_batch))
        if wait:
            self.ledger.wait_acked(last_batch, timeout=self._ack_wait_s)
        with self.ledger.lock:
            last = self.batches.get(last_batch)
            goes_on = self._decide(last)
            unpolled = self._unpolled(last) if goes_on else []
        for agent, conn in unpolled:
            # A drain waits for partitions no poll of its own answered; consumers of the query that no
            # read polled in that batch may hold them: they leave, and the broker gives their partitions
            # to polled ones.
            self._trim(agent, conn, Trim(last_batch, 0.0))
        return goes_on

    def _trim(self, agent: str, conn: wire.RpcConnection, m: Trim):
        """Ask ``agent`` to close idle consumers; its answer (on the wire's thread) says how many it closed,
        and the member count drops by that many: a count left high would keep the query at its cap with
        no consumer open, every read empty."""
        f = call_async(conn, m)

        def closed(f):
            if f.cancelled() or f.exception() is not None:  # gone or slow: asked again after a while
                return
            rep, _ = f.result()
            with self.ledger.lock:
                self.members.closed(agent, int(rep["closed"]))

        f.add_done_callback(closed)
        return f

    def _unpolled(self, last: BatchState | None) -> list[tuple[str, wire.RpcConnection]]:
        """After an empty batch of a drain with unanswered partitions, once: the agents (and connections)
        holding consumers that no read of that batch polled; never after a replayed batch, which polls
        nothing. Call with the ledger's lock held."""
        if (last is None or last.rows or last.state == VOID or self.policy.available_now_target is None
                or not self.policy.unresolved() or self._drain_trimmed >= last.batch):
            return []
        self._drain_trimmed = last.batch
        used = Counter(a["agent"] for a in last.acquired.values() if a.get("session"))
        return [(name, self.agents[name]) for name, a in self.members.agents.items()
                if a.members > used[name] and name in self.agents]

    def _decide(self, last: BatchState | None) -> bool:
        """The policy's answer for a batch after ``last``; a drain that ends with partitions no poll of
        the query answered says so, once. Call with the ledger's lock held."""
        self._earlier_run_let_go()
        goes_on = self.policy.should_run(last, self.metadata.version, time.monotonic())
        if not goes_on and self.policy.left_unread and not self._left_reported:
            self._left_reported = True
            left = self.policy.left_unread
            log.warning("spark-share tracker %s: the drain ends with %d partitions that no consumer of this query "
                        "was given for %.0f s, so records of them below the start's high watermarks may be left in "
                        "the queue: %s. Another member of share group %r holds them (another query or consumer on "
                        "the same group?)", self.tracker_id, len(left), AVAILABLE_NOW_UNRESOLVED_S,
                        ", ".join(f"{t}-{p}" for t, p in left[:20]), self.opts.group_id)
        return goes_on

    def plan(self, batch: int, max_records: int | None) -> BatchState | None:
        """Create ``batch`` (from latestOffset only: the one place a batch that reads is made) and start
        its polls; None once the query is stopping."""
        b, new = self.ledger.plan(batch, max_records, self.metadata.version)
        if new and b is not None and b.slots and self.policy.prefetches(b.slots):
            b.prefetched = self.roster.prefetch(b)
        return b

    def batch_to_read(self, batch: int) -> BatchState | None:
        if self.query_id is None and self.opts.read_mode == "driver":
            self._learn_commit_log()  # Spark wrote this batch's offsets: they name the query this run serves
        return self.ledger.batch_to_read(batch)

    def slot_budgets(self, b: BatchState) -> list[int | None]:
        return self.policy.slot_budgets(b)

    # acknowledgements ---------------------------------------------------------------------
    @property
    def _ack_wait_s(self) -> float:
        return self.opts.ack_timeout_ms / 1000.0 + 5

    def batch_committed(self, upto: int, wait: bool = True) -> None:
        """Spark has committed every batch <= ``upto``: acknowledge them (ACCEPT unless a verdict
        says otherwise), through the agents that acquired the records."""
        for b in self.ledger.due(upto):
            self._acknowledge(b, ACCEPT)
        # Another thread (the commit listener) may be sending some of them: they must be queued on
        # the consumers before a poll of the next batch can be.
        self.ledger.wait_acked(upto, (ACKING,), timeout=self._ack_wait_s)
        if wait:
            self.ledger.wait_acked(upto, timeout=self._ack_wait_s)
        if self.failure:
            raise SourceError(self.failure)

    def _acknowledge(self, b: BatchState, default: int) -> None:
        failure = self.acks.acknowledge(b, default, queued=self.ledger.notify)
        if failure and default == ACCEPT:  # a committed batch given back: a later run must not ACCEPT it unseen
            self.released_committed.add(b.batch)
        if failure and not self.failure:
            self.failure = failure

    def _after_batch(self, b: BatchState) -> None:
        """Once ``b`` is acknowledged (the acknowledger's thread, off Spark's path): agents holding share
        consumers that no read used lately close them, within a record lock of their last poll, so a
        host Spark stopped reading on gives its members back (their partitions go to polled ones)."""
        idle_s = self.policy.lock_ms / 2000.0
        with self.ledger.lock:
            if self.ledger.stopping:
                return
            self.members.settled(b.batch)
            asked = [(a, self.agents.get(a)) for a in self.members.idle(b.batch, idle_s)]
        wait_futures([self._trim(a, conn, Trim(b.batch - IDLE_BATCHES + 1, idle_s)) for a, conn in asked if conn],
                     timeout=TRIM_TIMEOUT_S)

    def _let_go_of(self, agents_closed: bool, failed_before: int) -> int | None:
        """At a stop: the last batch this run planned if it holds nothing of the group any more (every batch
        answered by the broker, no acknowledgement failed at the stop, every agent closed its consumers, none
        lost within a record lock), else None. A later run that replays that batch need not wait for locks."""
        lost = self.roster.lost_at
        with self.ledger.lock:
            if (not self.batches or not agents_closed or self.ledger.totals.failed != failed_before
                    or any(b.state not in FINISHED for b in self.batches.values())
                    or (lost is not None and time.monotonic() - lost < self.policy.lock_ms / 1000.0)):
                return None
            return max(self.batches)

    def _earlier_run_let_go(self) -> None:
        """A drain that replays a batch of an earlier run: if that run (on this host) stopped holding nothing,
        no record of it is locked and the drain does not wait for any. Call with the ledger's lock held."""
        if self.policy.locked_elsewhere_until is None or self.query_id is None or self._earlier_run_checked:
            return
        self._earlier_run_checked = True
        final = runtime.read_json(runtime.final_counts_path(self.query_id)) or {}
        if final.get("letGoOfBatch") == self.policy.replayed_batch:
            self.policy.earlier_run_let_go()
            log.info("spark-share tracker %s: the run that planned batch %d stopped holding nothing: the drain "
                     "waits for no locked record", self.tracker_id, self.policy.replayed_batch)

    # shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """ACCEPT the batches Spark committed (it said so, or its commit log shows it), RELEASE every
        other held batch, wait (bounded) for the broker's answers, stop the agents, close.

        Safe from any thread while another is anywhere in a call (SIGTERM runs it on its own thread):
        once ``stopping`` is set nothing is planned, claimed or acknowledged by anyone else, and every
        wait here is bounded, so a stop never hangs on a half-finished call. A second caller waits for
        the first to finish."""
        pending = self.ledger.due_at_stop()
        if pending is None:
            self._stopped.wait(3 * SHUTDOWN_WAIT_S)
            return
        try:
            self._learn_commit_log()
            failed_before = self.ledger.totals.failed
            for b in pending:
                if self.ledger.committed(b, self.commit_log, self.tracker_id):
                    b.committed_at = time.time()
                    self._acknowledge(b, ACCEPT)
                else:
                    self._acknowledge(b, RELEASE)
            if self.batches:
                # Batches another thread is acknowledging are queued first, then the broker answers.
                self.ledger.wait_acked(max(self.batches), (ACKING,), timeout=SHUTDOWN_WAIT_S)
                self.ledger.wait_acked(max(self.batches), timeout=SHUTDOWN_WAIT_S)
            self.acks.close()
            agents_closed = self.roster.stop_all(SHUTDOWN_WAIT_S)
            self.server.close()
            self.metadata.close()
            final = self.progress()
            if self.query_id is not None:  # before the registry entry goes: status() waits for one or the other
                runtime.write_private_json(runtime.final_counts_path(self.query_id), {
                    **final, "query": self.query_id, "view": "final",
                    "waitedForLockedRecords": self.policy.waiting_for_locks,
                    "letGoOfBatch": self._let_go_of(agents_closed, failed_before)})
            # Under the run's own id, which its offsets carry: a later run replaying its batch reads it there.
            runtime.write_private_json(runtime.run_end_path(self.tracker_id), {
                "consumersClosed": agents_closed, "releasedCommitted": sorted(self.released_committed)})
            self.registration.remove()
            log.info("spark-share tracker %s stopped: %s", self.tracker_id, json.dumps(final))
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
        finally:
            self._stopped.set()
