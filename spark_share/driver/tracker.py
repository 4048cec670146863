"""The driver-side tracker: which batch holds what, and when it gets acknowledged.

Lives in the reader's runner process (``python_streaming_source_runner``), started lazily by
the reader. Owns: the per-query secret, the TCP server agents and the user's process connect
to, the batches of this run (the one place a batch that reads is created, ``plan``), the claims
of (batch, slot) by agents, what each acquired and the verdicts on it, which of its batches Spark
runs under which batch id, how far Spark has committed (``committed_upto``), the registry entry
through which the user's process (foreachBatch, the listener) finds it, and the stop. It asks the
policy (``policy``) whether a batch runs and how big, the watermark thread (``watermarks``) whether
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

from .. import runtime
from ..errors import BatchRefused, SourceError
from ..executor.deadletter import check_target
from ..options import ShareSourceOptions, scrub
from ..transport import wire
from ..transport.protocol import (
    TO_TRACKER,
    Acquired,
    Claim,
    Committed,
    Fetch,
    Hello,
    Prefetch,
    Shutdown,
    Status,
    Verdicts,
    call,
    call_async,
    dispatcher,
)
from . import backlog
from .acks import AGENT_LOST, Acknowledger
from .batches import (
    ACCEPT,
    ACKED,
    ACKING,
    FINISHED,
    IN_FLIGHT,
    PLANNED,
    QUEUED,
    REJECT,
    RELEASE,
    RELEASED,
    VOID,
    AckOutcome,
    BatchState,
)
from .commitlog import CommitLog
from .policy import DEFAULT_RECORD_LOCKS, BatchPolicy
from .watermarks import MetadataWatcher

log = logging.getLogger("spark_share.driver.tracker")

__all__ = ["Tracker", "AGENT_LOST"]

TWO_SOURCES = ("this query reads two kafka-share sources; spark-share supports one per query: run a query per "
               "share group (or subscribe one source to several topics)")
KEEP_FINISHED = 20  # acknowledged batches kept for status(); older ones are dropped (a stream runs for days)
SHUTDOWN_WAIT_S = 10.0  # a stop waits this long at most for acknowledgements under way, then for agents
BACKLOG_LOG_S = 60.0  # the backlog estimate's INFO line, at most this often


def one_host() -> bool:
    """Local mode (or a master ``register()`` did not pass): every read task runs on this host."""
    master = os.environ.get("SPARK_SHARE_MASTER", "")
    return not master or master.startswith("local")


def _bind_host() -> str:
    """The narrowest interface executors can reach: loopback in local mode, else the address they
    already reach the driver on. ``register()`` passes the master and driver host to this process
    through the SparkContext's environment; SPARK_SHARE_BIND_HOST overrides."""
    explicit = os.environ.get("SPARK_SHARE_BIND_HOST")
    if explicit:
        return explicit
    if not one_host():
        return (os.environ.get("SPARK_SHARE_DRIVER_HOST") or os.environ.get("SPARK_LOCAL_IP")
                or socket.gethostbyname(socket.gethostname()))
    return "127.0.0.1"


def _port_text(ports: tuple[int, int]) -> str:
    return str(ports[0]) if ports[0] == ports[1] else f"{ports[0]}-{ports[1]}"


class Tracker:
    HANDLERS = {Hello: "_hello", Claim: "_claim", Acquired: "_acquired", Fetch: "_relay",
                Committed: "_committed", Verdicts: "_verdicts", Status: "_status"}

    def __init__(self, opts: ShareSourceOptions):
        self.opts = opts
        self.tracker_id = uuid.uuid4().hex[:16]
        self.secret = wire.new_secret()
        self._secrets = opts.secret_values()
        self._lock = threading.RLock()
        self._acked = threading.Condition(self._lock)  # a batch's acknowledgement finished
        self._register_lock = threading.Lock()
        self.failure: str | None = None  # why the query must stop (set once, raised by latestOffset)
        self.commit_log: CommitLog | None = None  # Spark's commit log of the query, once the listener noted it
        self.batches: dict[int, BatchState] = {}
        self.agents: dict[str, wire.RpcConnection] = {}
        self.query_id: str | None = None
        self._registry_path: str | None = None
        # Created before the watcher, whose thread asks it whether the stream is idle; the slots are
        # known once the watcher has listed the partitions.
        self.policy = BatchPolicy(opts.num_partitions or 1, opts.idle_probe_ms, opts.max_records_per_trigger)
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
            self.server = self._listen(_bind_host())
        except BaseException:
            self.metadata.close()
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
            raise
        self.address = self.server.address
        # Last, once nothing here can fail: foreachBatch under Spark Connect and the listener on the
        # server find the tracker by its id (its query id is not known yet).
        self._run_path = runtime.run_registry_path(self.tracker_id)
        runtime.write_private_json(self._run_path, self._entry())
        self.policy.num_slots = opts.num_partitions or max(1, len(self.metadata.partitions))
        self.policy.partitions = max(1, len(self.metadata.partitions))
        broker_locks, lock_ms = self.metadata.share_limits()
        if lock_ms is not None:
            self.policy.lock_ms = float(lock_ms)
        locks, said = opts.max_record_locks, "option maxRecordLocks"
        if locks is None:
            locks, said = broker_locks, "the broker's group.share.partition.max.record.locks"
        if locks is None:
            locks, said = DEFAULT_RECORD_LOCKS, "Kafka's default (the broker did not say; set maxRecordLocks)"
        self.policy.record_locks = locks
        self.acks = Acknowledger(opts, self.policy, self._lock, self.agents, self._acknowledged)
        self.totals = AckOutcome()
        self.total_acquired = 0
        self.relays = 0  # re-reads served from another host's agent, through this process
        self.relayed_bytes = 0
        # Spark has committed every batch up to here (it said so through latestOffset, commit or the
        # listener): the one fact that lets a batch be ACCEPTed, recorded before anything acts on it.
        self.committed_upto = -1
        self.stopping = False  # set once by shutdown: nothing new is planned, claimed or acknowledged
        self._stopped = threading.Event()
        log.info("spark-share tracker %s for group %r, topics %s (%d partitions), %d slots, listening on %s:%d",
                 self.tracker_id, opts.group_id, list(opts.topics), len(self.metadata.partitions),
                 self.policy.num_slots, *self.address)
        log.info("record locks per partition: %d, from %s: a batch holds at most %d records, %d per consumer",
                 locks, said, self.policy.lock_budget, self.policy.poll_size(None))
        log.info("record lock duration: %.0f ms, %s", self.policy.lock_ms,
                 "the group's share.record.lock.duration.ms" if lock_ms is not None
                 else "Kafka's default (the broker did not say)")

    def _latest(self) -> BatchState | None:
        with self._lock:
            return self.batches[max(self.batches)] if self.batches else None

    # requests from agents and the user's process ----------------------------------------
    def _listen(self, host: str) -> wire.RpcServer:
        """Listen for agents on ``host``, on a port of the option 'trackerPort' (any free one by default)."""
        first, last = self.opts.tracker_ports
        error: OSError | None = None
        for port in range(first, last + 1):
            try:
                return wire.RpcServer((host, port), self.secret, dispatcher(self, self.HANDLERS, TO_TRACKER),
                                      name="tracker", on_close=self._conn_closed,
                                      scrub=lambda s: scrub(s, self._secrets), encrypt=self.opts.encrypt_network)
            except OSError as e:  # taken: try the next one
                error = e
        raise SourceError(f"option 'trackerPort' = {_port_text(self.opts.tracker_ports)!r}: no port of it is free on "
                          f"{host} ({error}); give a wider range, or 0 for any free port")

    def _hello(self, conn: wire.RpcConnection, m: Hello) -> dict:
        with self._lock:
            self.agents[m.agent_id] = conn
        conn.info["agent_id"] = m.agent_id
        conn.info["host"] = m.host
        log.info("agent %s joined (pid %s on %s)", m.agent_id, m.pid, m.host)
        # No client config here: credentials reach agents with the read task, never over this socket.
        latest = self._latest()
        if latest is not None and latest.state == PLANNED and latest.slots and not latest.claims:
            self._prefetch(latest)  # planned before this agent joined: it polls once its sessions have
        limit = self.policy.current_limit(latest)
        # The sessions an agent joins with. One host reads every slot. On a cluster each host's pool
        # grows with the slots its tasks read in a batch (a session serves one slot per batch), so
        # the group has about numPartitions members, never executors x numPartitions.
        slots = self.policy.slots_for(limit) if one_host() else 1
        return {"max_poll_records": self.policy.poll_size(latest),
                "topics": list(self.opts.topics), "include_headers": self.opts.include_headers,
                "slots": slots,
                "dead_letter": self.opts.dead_letter, "dead_letter_topic": self.opts.dead_letter_topic,
                "dead_letter_path": self.opts.dead_letter_path, "max_delivery_count": self.opts.max_delivery_count}

    def _claim(self, conn: wire.RpcConnection, m: Claim) -> dict:
        """Which agent reads (batch, slot): the one that acquired it (every re-read gets the same rows),
        else the asking one, which polls. ``owner`` None: the slot's records were acquired by an agent
        that is gone; its rows may already be in a sink, so the slot reads nothing rather than new
        records under the same batch id (the lost ones are released by the broker and come back)."""
        batch, slot = m.batch, m.slot
        agent_id = self._agent_of(conn)
        qid = m.query_id
        if qid and self.query_id is None:
            with self._register_lock:  # the read tasks of the first batch claim at the same time
                if self.query_id is None:
                    self._register_query(qid)
        with self._lock:
            b = self.batches.get(batch)
            if self.stopping or b is None or b.state != PLANNED:
                raise BatchRefused(self._refusal(batch, b))
            if m.spark_batch is not None:
                b.spark_batch = int(m.spark_batch)
            if m.connect_session:
                b.connect_sessions.add(m.connect_session)
            owner = b.claims.get(slot)
            if owner is not None and owner not in self.agents:
                if slot in b.acquired:
                    log.warning("batch %d slot %d: agent %s that acquired it is gone; this read gets no rows (its "
                                "records are released by the broker and come back in a later batch)",
                                batch, slot, owner)
                    return {"owner": None}
                owner = None  # claimed but never acquired: no row of it reached Spark
            if owner is None:
                b.claims[slot] = owner = agent_id
        return {"owner": owner, "carry_ms": self.policy.carry_ms}

    def _refusal(self, batch: int, b: BatchState | None) -> str:
        """Why a read of ``batch`` may acquire nothing. Call with ``_lock`` held."""
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

    @staticmethod
    def _agent_of(conn: wire.RpcConnection) -> str:
        if "agent_id" in conn.info:
            return conn.info["agent_id"]
        raise RuntimeError("request from a connection that did not say hello")

    def _acquired(self, conn: wire.RpcConnection, m: Acquired) -> dict:
        with self._lock:
            b = self.batches[m.batch]
            b.acquired[m.slot] = {"agent": self._agent_of(conn), "session": m.session, "rows": m.rows,
                                  "acquired_at": m.acquired_at, "offsets": m.offsets, "timed_out": m.timed_out}
            self.policy.acquired(m.offsets, m.redelivered, (self._agent_of(conn), m.session), m.carried)
            limit = self.opts.max_delivery_count
            for t, p, o, count in m.poison:
                b.verdicts[(t, int(p), int(o))] = (REJECT, f"deliveryCount {count} reached maxDeliveryCount {limit}")
            if m.poison:
                log.warning("batch %d: %d records reached maxDeliveryCount %s; they are rejected to the dead-letter "
                            "target instead of being processed again", m.batch, len(m.poison), limit)
            self.total_acquired += m.rows
            conn.info["members"] = m.members
        return {"ok": True}

    def _relay(self, conn: wire.RpcConnection, m: Fetch) -> tuple[dict, bytes]:
        with self._lock:
            owner = self.batches[m.batch].claims.get(m.slot)
            agent = self.agents.get(owner) if owner else None
        if agent is None:
            raise RuntimeError(f"batch {m.batch} slot {m.slot} is held by no live agent")
        # One slot's records pass through here per re-read, and are let go once sent on.
        rep, blob = call(agent, Fetch(m.batch, m.slot), timeout=120)
        with self._lock:
            self.relays += 1
            self.relayed_bytes += len(blob)
        return rep, blob

    def _committed(self, conn: wire.RpcConnection, m: Committed) -> dict:
        if m.query_id and self.query_id is None:  # the reads did not carry it (foreachBatch under Connect)
            with self._register_lock:
                if self.query_id is None:
                    self._register_query(m.query_id)
        upto = m.source_batch if m.source_batch is not None else self.source_batch_of(m.spark_batch)
        if upto is not None:
            self.batch_committed(upto, wait=True)
        return {"ok": True}

    def _status(self, conn: wire.RpcConnection, m: Status) -> dict:
        return self.status()

    def source_batch_of(self, spark_batch: int) -> int | None:
        """Our batch that Spark ran as ``spark_batch`` or, if that one read nothing of ours, the
        last one before it."""
        with self._lock:
            mapped = [n for n, b in self.batches.items() if b.spark_batch is not None and b.spark_batch <= spark_batch]
        return max(mapped) if mapped else None

    def _verdicts(self, conn: wire.RpcConnection, m: Verdicts) -> dict:
        """Record reject/release verdicts for a running batch; all or nothing."""
        kind = {"reject": REJECT, "release": RELEASE}[m.kind]
        reason = m.reason
        with self._lock:
            if m.connect_session:  # Spark Connect: the latest batch read in that session, if it is ours
                b = max((b for b in self.batches.values()
                         if m.connect_session in b.connect_sessions and b.state == PLANNED),
                        key=lambda b: b.batch, default=None)
                if b is None:
                    return {"match": False}
            else:
                b = next((b for b in self.batches.values() if b.spark_batch == m.spark_batch), None)
                if b is None or b.state != PLANNED:
                    raise ValueError(f"batch {m.spark_batch} has no kafka-share records being processed in this "
                                     f"query (state: {b.state if b else 'nothing read'}); verdicts apply to rows of "
                                     "the batch being processed in foreachBatch")
            batch = b.spark_batch if b.spark_batch is not None else b.batch
            keys = [(t, int(p), int(o)) for t, p, o in m.records]
            foreign = [k for k in keys if not b.holders(*k)]
            if foreign:
                raise ValueError(f"{len(foreign)} of {len(keys)} rows are not from batch {batch} of this query, e.g. "
                                 + ", ".join(f"{t}-{p}@{o}" for t, p, o in foreign[:5]))
            both = [k for k in keys if k in b.verdicts and b.verdicts[k][0] != kind]
            if both:
                raise ValueError(f"{len(both)} rows were already given the opposite verdict (a row cannot be both "
                                 "rejected and released), e.g. " + ", ".join(f"{t}-{p}@{o}" for t, p, o in both[:5]))
            for k in keys:
                b.verdicts[k] = (kind, reason)
        return {"ok": True, "match": True, "records": len(keys)}

    def _conn_closed(self, conn: wire.RpcConnection) -> None:
        agent_id = conn.info.get("agent_id")
        if agent_id:
            with self._lock:
                if self.agents.get(agent_id) is conn:
                    del self.agents[agent_id]
                self.policy.forget_agent(agent_id)  # what it carried goes back to the group with its sessions
            if not self.stopping:
                log.warning("agent %s disconnected; records it held go back to the share group", agent_id)

    def _register_query(self, query_id: str) -> None:
        """Write host/port/secret where the user's process on this host (foreachBatch) finds it."""
        other = runtime.live_registry_entry(query_id)
        if other and other.get("tracker_id") != self.tracker_id:
            # The user's process finds a query's tracker by the query id alone: a second kafka-share
            # source in the same query would take the first one's verdicts and commit signals.
            raise SourceError(TWO_SOURCES)
        self.query_id = query_id
        path = runtime.registry_path(query_id)
        runtime.write_private_json(path, self._entry())
        if (runtime.live_registry_entry(query_id) or {}).get("tracker_id") != self.tracker_id:  # the other won a race
            raise SourceError(TWO_SOURCES)
        self._registry_path = path
        log.info("spark-share tracker %s serves query %s", self.tracker_id, query_id)
        self._learn_commit_log()

    def _entry(self) -> dict:
        """What the registry says of this tracker (owner-only files: the secret is in it)."""
        return {"host": self.address[0], "port": self.address[1], "secret": self.secret,
                "tracker_id": self.tracker_id, "pid": os.getpid()}

    def _learn_commit_log(self) -> None:
        if self.commit_log is None and self.query_id is not None:
            self.commit_log = CommitLog.of_query(self.query_id)

    # planning -----------------------------------------------------------------------------
    def prepare_available_now(self) -> None:
        self.metadata.refresh()
        self.policy.start_available_now(self.metadata.high)

    def should_run(self, last_batch: int) -> bool:
        """Is a batch after ``last_batch`` worth running? Answers from memory (see ``policy``)."""
        with self._lock:
            wait = self.policy.needs_acknowledgements(self.batches.get(last_batch))
        if wait:
            self._wait_acked(last_batch)
        with self._lock:
            return self.policy.should_run(self.batches.get(last_batch), self.metadata.version, time.monotonic())

    def plan(self, batch: int, max_records: int | None) -> BatchState | None:
        """Create ``batch`` (from latestOffset only: the one place a batch that reads is made) and start
        its polls; None once the query is stopping."""
        with self._lock:
            if self.stopping:
                return None
            old = self.batches.get(batch)
            b = old or BatchState(batch, self.policy.slots_of_new_batch(max_records), max_records)
            self.batches[batch] = b
            self.policy.planned(self.metadata.version, time.monotonic())
        if old is None and b.slots:
            self._prefetch(b)
        return b

    def batch_to_read(self, batch: int) -> BatchState | None:
        """The batch Spark wants read tasks for, or None when it must read nothing: a batch this run did
        not plan (after a restart Spark replays the last batch of the earlier run, whose records were
        released: new records under its id would be ACCEPTed although an idempotent sink skips the
        replayed id), or any batch once the query is stopping."""
        with self._lock:
            b = self.batches.get(batch)
            if b is None:
                b = self.batches[batch] = BatchState(batch, 0, None, state=VOID)
                log.warning("spark-share batch %d was planned by an earlier run of this query: Spark replays it, "
                            "and it reads nothing (the records that run held were released; they come back in "
                            "later batches)", batch)
            if self.stopping or b.state != PLANNED:
                return None
            return b

    def _prefetch(self, b: BatchState) -> None:
        """On one host, ask its agent to start every poll of ``b`` now, while Spark writes its offsets
        and schedules the read tasks. On a cluster, nothing: Spark does not say where a batch's
        tasks will run (a Python source has no preferred locations), and records polled on a host
        where no task of the batch lands would be held until a later batch reads there. A batch
        planned before the agent joined is sent when it joins (``_hello``)."""
        if not one_host():
            return
        with self._lock:
            conns = list(self.agents.values())
        if len(conns) == 1:  # one agent per query run on a host
            call_async(conns[0], Prefetch(b.batch, b.slots, self.slot_budgets(b)[0], self.opts.poll_timeout_ms,
                                          self.policy.carry_ms))

    def slot_budgets(self, b: BatchState) -> list[int | None]:
        return self.policy.slot_budgets(b)

    # acknowledgements ---------------------------------------------------------------------
    def batch_committed(self, upto: int, wait: bool = True) -> None:
        """Spark has committed every batch <= ``upto``: acknowledge them (ACCEPT unless a verdict
        says otherwise), through the agents that acquired the records."""
        with self._lock:
            self.committed_upto = max(self.committed_upto, upto)
            if self.stopping:  # shutdown acknowledges what is left, knowing it was committed
                todo = []
            else:
                todo = [b for n, b in sorted(self.batches.items()) if n <= upto and b.state == PLANNED]
            for b in todo:
                b.state = ACKING
                b.committed_at = time.time()
        for b in todo:
            self._acknowledge(b, ACCEPT)
        # Another thread (the commit listener) may be sending some of them: they must be queued on
        # the consumers before a poll of the next batch can be.
        self._wait_acked(upto, (ACKING,))
        if wait:
            self._wait_acked(upto)
        if self.failure:
            raise SourceError(self.failure)

    def _wait_acked(self, upto: int, pending=(ACKING, QUEUED), timeout: float | None = None) -> None:
        """Until no batch <= ``upto`` is in a ``pending`` state (bounded by the ack timeout)."""
        with self._acked:
            self._acked.wait_for(lambda: all(b.state not in pending for n, b in self.batches.items() if n <= upto),
                                 timeout=self.opts.ack_timeout_ms / 1000.0 + 5 if timeout is None else timeout)

    def _acknowledge(self, b: BatchState, default: int) -> None:
        failure = self.acks.acknowledge(b, default, queued=self._acked.notify_all)
        if failure and not self.failure:
            self.failure = failure

    def _acknowledged(self, b: BatchState, default: int) -> None:
        """The broker answered ``b``'s acknowledgements (called by the acknowledger, under the lock)."""
        b.state = ACKED if default == ACCEPT else RELEASED
        self.totals.add(b.outcome)
        self.policy.acknowledged(b)
        finished = sorted(n for n, x in self.batches.items() if x.state in FINISHED)
        for n in finished[:-KEEP_FINISHED]:
            del self.batches[n]
        self._acked.notify_all()

    # progress -----------------------------------------------------------------------------
    def _estimate_backlog(self) -> None:
        """After a watermark refresh (the watermark thread): the backlog estimate that progress and
        status() report, and its log line once a minute."""
        metadata = getattr(self, "metadata", None)  # None while its constructor runs
        if metadata is None:
            return
        with self._lock:
            held = backlog.in_flight(a for b in self.batches.values() if b.state in IN_FLIGHT
                                     for a in b.acquired.values())
            self.backlog = view = backlog.estimate(metadata.high, self.policy.max_seen, held)
        now = time.monotonic()
        if now - self._backlog_logged >= BACKLOG_LOG_S:
            self._backlog_logged = now
            log.info("%s", backlog.line(view))

    def progress(self) -> dict:
        with self._lock:
            planned = max(self.batches) if self.batches else None
            inflight = sum(b.rows for b in self.batches.values() if b.state in IN_FLIGHT)
            done = [b for b in self.batches.values() if b.state in (ACKED, RELEASED)]
            last = max(done, key=lambda b: b.batch).summary() if done else None
            t = self.totals
        return {"v": 1, "tracker": self.tracker_id, "batch": planned, "inflightRecords": inflight, "agents": len(self.agents),
                "maxRecordsPerConsumer": self.policy.lock_safe_records, "lockBudget": self.policy.lock_budget,
                "lockDurationMs": self.policy.lock_ms,
                "lockHeadroomMs": self.policy.headroom_ms(last.get("holdMs") if last else None),
                "acquired": self.total_acquired, "accepted": t.accepted, "released": t.released,
                "rejected": t.rejected, "expired": t.expired, "failed": t.failed,
                "relayed": {"reads": self.relays, "bytes": self.relayed_bytes},
                "lastAcked": last, "backlogEstimate": self.backlog.get("backlogEstimate"),
                "backlog": self.backlog.get("partitions")}

    def status(self) -> dict:
        out = self.progress()
        out["query"] = self.query_id
        with self._lock:
            out["batches"] = [b.summary() for _, b in sorted(self.batches.items())[-20:]]
            out["sessions"] = sorted({a.get("session") for b in self.batches.values() for a in b.acquired.values()
                                      if a.get("session")})
            read = [b for _, b in sorted(self.batches.items()) if b.claims]
            claims = list(read[-1].claims.values()) if read else []
            hosts: dict[str, dict] = {}
            for agent_id, conn in self.agents.items():
                h = hosts.setdefault(conn.info.get("host") or "?", {"agents": 0, "members": 0, "slots": 0})
                h["agents"] += 1
                h["members"] += conn.info.get("members", 0)
                h["slots"] += claims.count(agent_id)
            # Per host: group members (as of each agent's last acquisition), and the slots of the
            # last batch read that its agents hold.
            out["hosts"] = hosts
        return out

    # shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """ACCEPT the batches Spark committed (it said so, or its commit log shows it), RELEASE every
        other held batch, wait (bounded) for the broker's answers, stop the agents, close.

        Safe from any thread while another is anywhere in a call (SIGTERM runs it on its own thread):
        once ``stopping`` is set nothing is planned, claimed or acknowledged by anyone else, and every
        wait here is bounded, so a stop never hangs on a half-finished call. A second caller waits for
        the first to finish."""
        with self._lock:
            first = not self.stopping
            self.stopping = True
            pending = [b for _, b in sorted(self.batches.items()) if b.state == PLANNED] if first else []
            for b in pending:
                b.state = ACKING
        if not first:
            self._stopped.wait(3 * SHUTDOWN_WAIT_S)
            return
        try:
            self._learn_commit_log()
            for b in pending:
                if b.batch <= self.committed_upto or (self.commit_log and self.commit_log.has(b.spark_batch)):
                    b.committed_at = time.time()
                    self._acknowledge(b, ACCEPT)
                else:
                    self._acknowledge(b, RELEASE)
            if self.batches:
                # Batches another thread is acknowledging are queued first, then the broker answers.
                self._wait_acked(max(self.batches), (ACKING,), timeout=SHUTDOWN_WAIT_S)
                self._wait_acked(max(self.batches), timeout=SHUTDOWN_WAIT_S)
            self.acks.close()
            with self._lock:
                conns = list(self.agents.values())
            # Closing its consumers releases whatever an agent still holds.
            for c in conns:
                call_async(c, Shutdown())
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            for c in conns:
                c.wait_closed(max(0.0, deadline - time.monotonic()))
            self.server.close()
            self.metadata.close()
            runtime.remove(self._registry_path)
            runtime.remove(self._run_path)
            log.info("spark-share tracker %s stopped: %s", self.tracker_id, json.dumps(self.progress()))
            runtime.stop_logging_to(self._log_file)
            runtime.release_tracker_lock(self.tracker_id, self._alive_fd)
        finally:
            self._stopped.set()
