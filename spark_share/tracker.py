"""The driver-side tracker: which batch holds what, and when it gets acknowledged.

Lives in the reader's runner process (``python_streaming_source_runner``), started lazily by
the reader. Owns: the per-query secret, the TCP server agents and the user's process connect
to, the claims of (batch, slot) by agents, each batch's acquired offsets, verdicts and
acknowledgement outcomes, the high watermarks that tell an idle stream whether a new batch is
worth running, which of its batches Spark runs under which batch id, and the registry file
through which the user's process (foreachBatch, the listener) finds it. It queues a committed
batch's acknowledgements on the agents (collecting the broker's answers in the background) and
has the agents start a batch's polls when it plans it.

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
import re
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from . import wire
from .agent import checkpoint_note_path, runtime_dir
from .options import ShareSourceOptions, scrub
from .session import ACCEPT, RELEASE, REJECT, AckOutcome

log = logging.getLogger("spark_share.tracker")


AVAILABLE_NOW_EMPTY_RETRIES = 5
TWO_SOURCES = ("this query reads two kafka-share sources; spark-share supports one per query: run a query per "
               "share group (or subscribe one source to several topics)")
KEEP_FINISHED = 20  # acknowledged batches kept for status(); older ones are dropped (a stream runs for days)
# Kafka's default group.share.record.lock.duration.ms. The client cannot read the group's value, so
# the tracker assumes this until a lock expiry shows it is shorter.
DEFAULT_LOCK_MS = 30_000
LOCK_WARN_FRACTION = 0.8
AGENT_LOST = "AGENT_LOST"  # the error a lost agent's records are counted under
SHUTDOWN_WAIT_S = 10.0  # a stop waits this long at most for acknowledgements under way, then for agents


class SourceError(RuntimeError):
    """A problem with the source's setup that the user must fix (topic, broker, options)."""


class BatchRefused(RuntimeError):
    """A read of a batch that cannot be served with its original rows, so it acquires nothing."""


@dataclass
class BatchState:
    batch: int
    slots: int
    max_records: Optional[int]
    planned_at: float = field(default_factory=time.time)
    claims: Dict[int, str] = field(default_factory=dict)         # slot -> agent id
    acquired: Dict[int, dict] = field(default_factory=dict)      # slot -> {session, rows, offsets, acquired_at}
    verdicts: Dict[Tuple[str, int, int], Tuple[int, Optional[str]]] = field(default_factory=dict)
    spark_batch: Optional[int] = None                            # Spark's batch id, learnt from the read tasks
    # planned -> acking (being sent) -> queued (on the consumers, ahead of their next poll) -> acked | released;
    # void: a batch this run did not plan (Spark replays an earlier run's batch): it reads nothing.
    state: str = "planned"
    committed_at: Optional[float] = None
    acked_at: Optional[float] = None
    outcome: AckOutcome = field(default_factory=AckOutcome)

    @property
    def rows(self) -> int:
        return sum(a.get("rows", 0) for a in self.acquired.values())

    def min_offsets(self) -> Dict[Tuple[str, int], int]:
        """Lowest offset acquired per partition (offsets arrive as sorted [first, last] runs)."""
        out: Dict[Tuple[str, int], int] = {}
        for a in self.acquired.values():
            for t, parts in a.get("offsets", {}).items():
                for p, runs in parts.items():
                    k = (t, int(p))
                    out[k] = min(runs[0][0], out.get(k, runs[0][0]))
        return out

    def holder(self, topic: str, partition: int, offset: int) -> Optional[str]:
        """The agent that acquired this record in this batch, or None."""
        for a in self.acquired.values():
            for lo, hi in a.get("offsets", {}).get(topic, {}).get(str(partition), ()):
                if lo <= offset <= hi:
                    return a["agent"]
        return None

    def held_ms(self) -> Optional[float]:
        """How long the batch held its records: from the first poll's return to its acknowledgement
        (or now). The broker's lock clock started a little earlier."""
        starts = [a["acquired_at"] for a in self.acquired.values() if a.get("rows") and a.get("acquired_at")]
        if not starts:
            return None
        return round(((self.acked_at or time.time()) - min(starts)) * 1000, 1)

    def summary(self) -> dict:
        d = {"batch": self.batch, "acquired": self.rows, "state": self.state}
        if self.spark_batch is not None and self.spark_batch != self.batch:
            d["sparkBatch"] = self.spark_batch
        if self.state == "planned":
            d["polling"] = len(self.claims) - len(self.acquired)  # read tasks waiting for their poll
        held = self.held_ms()
        if held is not None:
            d["holdMs"] = held
        d.update({k: v for k, v in self.outcome.as_dict().items() if k != "errors"})
        if self.outcome.errors:
            d["errors"] = dict(self.outcome.errors)
        if self.committed_at and self.acked_at:
            d["ackLatencyMs"] = round((self.acked_at - self.committed_at) * 1000, 1)
            d["ackedAt"] = round(self.acked_at, 3)
        return d


class MetadataWatcher:
    """A plain Kafka client kept alive for the whole run (the embedded broker drops every share
    session when any client disconnects) that refreshes high watermarks in the background while
    ``wanted()`` says they matter (an idle stream), and not otherwise."""

    def __init__(self, opts: ShareSourceOptions, timeout_s: float = 15.0, wanted=lambda: True):
        from confluent_kafka import Consumer, KafkaException

        self._opts = opts
        self._secrets = opts.secret_values()
        try:
            self.client = Consumer(opts.metadata_config())
        except (KafkaException, ValueError, TypeError) as e:
            raise SourceError(scrub(f"invalid Kafka client configuration: {e}", self._secrets)) from None
        try:
            md = self.client.list_topics(timeout=timeout_s)
        except KafkaException as e:
            self.client.close()
            raise SourceError(
                f"could not reach the Kafka cluster at kafka.bootstrap.servers={opts.bootstrap_servers!r} "
                f"within {timeout_s:.0f} s ({scrub(str(e.args[0]) if e.args else str(e), self._secrets)}); "
                "check the address, the network and the security settings") from None
        missing = [t for t in opts.topics if t not in md.topics or md.topics[t].error is not None]
        if missing:
            self.client.close()
            raise SourceError(f"topic(s) {missing} do not exist on {opts.bootstrap_servers!r}; create them first "
                              f"(existing topics: {sorted(t for t in md.topics if not t.startswith('__'))[:20]})")
        self.partitions: List[Tuple[str, int]] = sorted(
            (t, p) for t in opts.topics for p in md.topics[t].partitions)
        self.high: Dict[Tuple[str, int], int] = {}
        self.version = 0
        self._wanted = wanted
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="spark-share-watermarks", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        from confluent_kafka import TopicPartition

        changed = False
        for t, p in self.partitions:
            try:
                _, high = self.client.get_watermark_offsets(TopicPartition(t, p), timeout=5, cached=False)
            except Exception:
                continue
            if self.high.get((t, p)) != high:
                self.high[(t, p)] = high
                changed = True
        if changed:
            self.version += 1

    def _loop(self) -> None:
        interval = max(0.25, 0.02 * len(self.partitions))  # one ListOffsets request per partition
        while not self._stop.wait(interval):
            if self._wanted():
                self.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        try:
            self.client.close()
        except Exception:
            pass


def _prune_runtime_dir(max_age_s: float = 7 * 86400) -> None:
    """Logs untouched for a week go (live runs keep writing theirs; locks and sockets stay)."""
    base = runtime_dir()
    cutoff = time.time() - max_age_s
    for name in os.listdir(base):
        if name.endswith(".log"):
            path = os.path.join(base, name)
            try:
                if os.stat(path).st_mtime < cutoff:
                    os.unlink(path)
            except OSError:
                pass


def _log_to_file(path: str) -> logging.Handler:
    """The driver side's log lines also go to an owner-only file beside the agents' logs."""
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
    os.close(fd)
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("spark_share").addHandler(h)
    return h


def _local_commit_log(root: str) -> Optional[str]:
    """The commit log directory of a checkpoint this process can read, or None (a remote store)."""
    if root.startswith("file:"):
        root = "/" + root[len("file:"):].lstrip("/")
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", root):
        return None
    return os.path.join(root, "commits")


def _live_registry(path: str) -> Optional[dict]:
    """The registry entry at ``path`` if the tracker that wrote it still runs."""
    try:
        with open(path) as f:
            reg = json.load(f)
        os.kill(int(reg["pid"]), 0)
        return reg
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _bind_host() -> str:
    """The narrowest interface executors can reach: loopback in local mode, else the address they
    already reach the driver on. ``register()`` passes the master and driver host to this process
    through the SparkContext's environment; SPARK_SHARE_BIND_HOST overrides."""
    explicit = os.environ.get("SPARK_SHARE_BIND_HOST")
    if explicit:
        return explicit
    master = os.environ.get("SPARK_SHARE_MASTER", "")
    if master and not master.startswith("local"):
        return (os.environ.get("SPARK_SHARE_DRIVER_HOST") or os.environ.get("SPARK_LOCAL_IP")
                or socket.gethostbyname(socket.gethostname()))
    return "127.0.0.1"


class Tracker:
    def __init__(self, opts: ShareSourceOptions):
        self.opts = opts
        self.tracker_id = uuid.uuid4().hex[:16]
        self.secret = wire.new_secret()
        self._secrets = opts.secret_values()
        self._lock = threading.RLock()
        self._acked = threading.Condition(self._lock)  # a batch's acknowledgement finished
        self._register_lock = threading.Lock()
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-share-acks")
        self.failure: Optional[str] = None  # why the query must stop (set once, raised by latestOffset)
        self.commit_log: Optional[str] = None  # the query's local commit log directory, once the listener said
        self.batches: Dict[int, BatchState] = {}
        self.agents: Dict[str, wire.RpcConnection] = {}
        self.query_id: Optional[str] = None
        self._registry_path: Optional[str] = None
        # The last batch brought nothing (default and processingTime triggers): only then do the
        # watermarks decide whether a batch runs, so only then does the watcher refresh them.
        self.idle = False
        _prune_runtime_dir()
        self._log_file = _log_to_file(os.path.join(runtime_dir(), f"tracker-{self.tracker_id}.log"))
        try:
            self.metadata = MetadataWatcher(opts, wanted=lambda: self.idle)
        except BaseException:
            self._close_log()
            raise
        try:
            self._check_dead_letter_target()
        except BaseException:
            self.metadata.close()
            self._close_log()
            raise
        self.num_slots = opts.num_partitions or max(1, len(self.metadata.partitions))
        self.server = wire.RpcServer((_bind_host(), 0), self.secret, self._handle, name="tracker",
                                     on_close=self._conn_closed, scrub=lambda s: scrub(s, self._secrets))
        self.address = self.server.address
        self.last_plan_time = 0.0
        self.last_plan_hw_version = -1
        self.planned_any = False
        self.available_now_target: Optional[Dict[Tuple[str, int], int]] = None
        self.max_seen: Dict[Tuple[str, int], int] = {}  # highest offset acquired per partition in this run
        self.empty_streak = 0
        # Records this AvailableNow run gave back (released, failed or expired acks) and has not seen
        # again: an empty batch does not end the run while some are due (a few times, as above).
        self.redeliveries_due = 0
        # Set once an AvailableNow run has seen everything: one last batch without tasks acknowledges
        # the previous one and reports the totals in its progress, without an empty poll.
        self.closing = False
        self.totals = AckOutcome()
        # Records per slot that fit in the record lock; lowered whenever a batch's locks expire.
        self.lock_safe_records: Optional[int] = None
        self.lock_ms = float(DEFAULT_LOCK_MS)  # the record lock duration, as far as the tracker knows
        self.total_acquired = 0
        # Spark has committed every batch up to here (it said so through latestOffset, commit or the
        # listener): the one fact that lets a batch be ACCEPTed, recorded before anything acts on it.
        self.committed_upto = -1
        self.stopping = False  # set once by shutdown: nothing new is planned, claimed or acknowledged
        self._stopped = threading.Event()
        log.info("spark-share tracker %s for group %r, topics %s (%d partitions), %d slots, listening on %s:%d",
                 self.tracker_id, opts.group_id, list(opts.topics), len(self.metadata.partitions),
                 self.num_slots, *self.address)

    def _check_dead_letter_target(self) -> None:
        o = self.opts
        if o.dead_letter_topic:
            md = self.metadata.client.list_topics(o.dead_letter_topic, timeout=30)
            t = md.topics.get(o.dead_letter_topic)
            if t is None or t.error is not None:
                raise SourceError(f"option 'deadLetterTopic' = {o.dead_letter_topic!r}: the topic does not exist on "
                                  f"{o.bootstrap_servers!r}; create it first (rejected records are written there)")
            # Whether this client may write there shows at the first reject: a refused write fails the
            # query, naming the option, and acknowledges nothing of its batch.
        if o.dead_letter_path:
            from .deadletter import check_path

            check_path(o.dead_letter_path)

    # requests from agents and the user's process ----------------------------------------
    def _handle(self, conn: wire.RpcConnection, req: dict, blob: bytes):
        op = req.get("op")
        if op == "hello":
            return self._hello(conn, req), b""
        if op == "claim":
            return self._claim(conn, req), b""
        if op == "acquired":
            return self._acquired(conn, req), b""
        if op == "fetch":
            return self._relay(req)
        if op == "committed":
            upto = self.source_batch_of(int(req["spark_batch"]))
            if upto is not None:
                self.batch_committed(upto, wait=True)
            return {"ok": True}, b""
        if op == "verdicts":
            return self._verdicts(req), b""
        if op == "status":
            return self.status(), b""
        raise ValueError(f"unknown request {op!r}")

    def _hello(self, conn: wire.RpcConnection, req: dict) -> dict:
        agent_id = str(req["agent_id"])
        with self._lock:
            self.agents[agent_id] = conn
        conn.info["agent_id"] = agent_id
        log.info("agent %s joined (pid %s on %s)", agent_id, req.get("pid"), req.get("host"))
        # No client config here: credentials reach agents with the read task, never over this socket.
        limit = self._current_limit()
        return {"max_poll_records": None if limit is None else max(1, limit // self.slots_for(limit)),
                "topics": list(self.opts.topics), "include_headers": self.opts.include_headers,
                "slots": self.slots_for(limit),
                "dead_letter": self.opts.dead_letter, "dead_letter_topic": self.opts.dead_letter_topic,
                "dead_letter_path": self.opts.dead_letter_path, "max_delivery_count": self.opts.max_delivery_count}

    def _current_limit(self) -> Optional[int]:
        """The records-per-batch limit Spark asked for last (none under ReadAllAvailable): it sizes
        the agents' polls, so a poll never takes records the batch must give back."""
        with self._lock:
            if self.batches:
                return self.batches[max(self.batches)].max_records
        return self.opts.max_records_per_trigger

    def slots_for(self, limit: Optional[int]) -> int:
        return self.num_slots if limit is None else max(1, min(self.num_slots, limit))

    def _claim(self, conn: wire.RpcConnection, req: dict) -> dict:
        """Which agent reads (batch, slot): the one that acquired it (every re-read gets the same rows),
        else the asking one, which polls. ``owner`` None: the slot's records were acquired by an agent
        that is gone; its rows may already be in a sink, so the slot reads nothing rather than new
        records under the same batch id (the lost ones are released by the broker and come back)."""
        batch, slot = int(req["batch"]), int(req["slot"])
        agent_id = self._agent_of(conn)
        qid = req.get("query_id")
        if qid and self.query_id is None:
            with self._register_lock:  # the read tasks of the first batch claim at the same time
                if self.query_id is None:
                    self._register_query(qid)
        with self._lock:
            b = self.batches.get(batch)
            if self.stopping or b is None or b.state != "planned":
                raise BatchRefused(self._refusal(batch, b))
            if req.get("spark_batch") is not None:
                b.spark_batch = int(req["spark_batch"])
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
        return {"owner": owner}

    def _refusal(self, batch: int, b: Optional[BatchState]) -> str:
        """Why a read of ``batch`` may acquire nothing. Call with ``_lock`` held."""
        if self.stopping:
            return f"kafka-share batch {batch} cannot be read: the query is stopping"
        if b is not None and b.state == "void":
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

    def _acquired(self, conn: wire.RpcConnection, req: dict) -> dict:
        batch, slot = int(req["batch"]), int(req["slot"])
        with self._lock:
            b = self.batches[batch]
            b.acquired[slot] = {"agent": self._agent_of(conn), "session": req.get("session"),
                                "rows": int(req.get("rows", 0)), "acquired_at": req.get("acquired_at"),
                                "offsets": req.get("offsets", {})}
            for t, parts in (req.get("offsets") or {}).items():
                for p, runs in parts.items():
                    k = (t, int(p))
                    self.max_seen[k] = max(runs[-1][1], self.max_seen.get(k, -1))
            limit = self.opts.max_delivery_count
            for t, p, o, count in req.get("poison") or ():
                b.verdicts[(t, int(p), int(o))] = (REJECT, f"deliveryCount {count} reached maxDeliveryCount {limit}")
            if req.get("poison"):
                log.warning("batch %d: %d records reached maxDeliveryCount %s; they are rejected to the dead-letter "
                            "target instead of being processed again", batch, len(req["poison"]), limit)
            self.total_acquired += int(req.get("rows", 0))
            self.redeliveries_due = max(0, self.redeliveries_due - int(req.get("redelivered", 0)))
        return {"ok": True}

    def _relay(self, req: dict):
        batch, slot = int(req["batch"]), int(req["slot"])
        with self._lock:
            owner = self.batches[batch].claims.get(slot)
            conn = self.agents.get(owner) if owner else None
        if conn is None:
            raise RuntimeError(f"batch {batch} slot {slot} is held by no live agent")
        return conn.call({"op": "fetch", "batch": batch, "slot": slot}, timeout=120)

    def source_batch_of(self, spark_batch: int) -> Optional[int]:
        """Our batch that Spark ran as ``spark_batch`` or, if that one read nothing of ours, the
        last one before it."""
        with self._lock:
            mapped = [n for n, b in self.batches.items() if b.spark_batch is not None and b.spark_batch <= spark_batch]
        return max(mapped) if mapped else None

    def _verdicts(self, req: dict) -> dict:
        """Record reject/release verdicts for a running batch; all or nothing."""
        spark_batch = int(req["spark_batch"])
        kind = {"reject": REJECT, "release": RELEASE}[req["kind"]]
        reason = req.get("reason")
        with self._lock:
            b = next((b for b in self.batches.values() if b.spark_batch == spark_batch), None)
            if b is None or b.state != "planned":
                raise ValueError(f"batch {spark_batch} has no kafka-share records being processed in this query "
                                 f"(state: {b.state if b else 'nothing read'}); verdicts apply to rows of the "
                                 "batch being processed in foreachBatch")
            batch = spark_batch
            keys = [(t, int(p), int(o)) for t, p, o in req["records"]]
            foreign = [k for k in keys if b.holder(*k) is None]
            if foreign:
                raise ValueError(f"{len(foreign)} of {len(keys)} rows are not from batch {batch} of this query, e.g. "
                                 + ", ".join(f"{t}-{p}@{o}" for t, p, o in foreign[:5]))
            both = [k for k in keys if k in b.verdicts and b.verdicts[k][0] != kind]
            if both:
                raise ValueError(f"{len(both)} rows were already given the opposite verdict (a row cannot be both "
                                 "rejected and released), e.g. " + ", ".join(f"{t}-{p}@{o}" for t, p, o in both[:5]))
            for k in keys:
                b.verdicts[k] = (kind, reason)
        return {"ok": True, "records": len(keys)}

    def _conn_closed(self, conn: wire.RpcConnection) -> None:
        agent_id = conn.info.get("agent_id")
        if agent_id:
            with self._lock:
                if self.agents.get(agent_id) is conn:
                    del self.agents[agent_id]
            if not self.stopping:
                log.warning("agent %s disconnected; records it held go back to the share group", agent_id)

    def _register_query(self, query_id: str) -> None:
        """Write host/port/secret where the user's process on this host (foreachBatch) finds it."""
        path = os.path.join(runtime_dir(), f"query-{query_id}.json")
        other = _live_registry(path)
        if other and other.get("tracker_id") != self.tracker_id:
            # The user's process finds a query's tracker by the query id alone: a second kafka-share
            # source in the same query would take the first one's verdicts and commit signals.
            raise SourceError(TWO_SOURCES)
        self.query_id = query_id
        fd = os.open(path + ".tmp", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"host": self.address[0], "port": self.address[1], "secret": self.secret,
                       "tracker_id": self.tracker_id, "pid": os.getpid()}, f)
        os.replace(path + ".tmp", path)
        if (_live_registry(path) or {}).get("tracker_id") != self.tracker_id:  # the other source won a race
            raise SourceError(TWO_SOURCES)
        self._registry_path = path
        log.info("spark-share tracker %s serves query %s", self.tracker_id, query_id)
        self._learn_commit_log()

    def _learn_commit_log(self) -> None:
        """Where Spark's commit log of this query is, from the note the listener wrote when the query
        started (a stop then ACCEPTs batches Spark committed before anyone told the tracker)."""
        if self.commit_log is not None or self.query_id is None:
            return
        try:
            with open(checkpoint_note_path(self.query_id)) as f:
                root = str(json.load(f)["root"])
        except (OSError, ValueError, KeyError):
            return
        self.commit_log = _local_commit_log(root) or ""
        log.info("spark-share tracker %s: commit log %s", self.tracker_id,
                 self.commit_log or f"not readable here ({root}): a stop releases batches nobody said were committed")

    # planning -----------------------------------------------------------------------------
    def prepare_available_now(self) -> None:
        self.metadata.refresh()
        self.available_now_target = dict(self.metadata.high)

    def _seen_all(self) -> bool:
        """Has this AvailableNow run acquired every record below the start's high watermarks?"""
        return all(self.max_seen.get(tp, -1) >= hw - 1 for tp, hw in self.available_now_target.items() if hw > 0)

    def should_run(self, last_batch: int) -> bool:
        """Is a batch after ``last_batch`` worth running? Answers from memory."""
        if self.available_now_target is not None and self.planned_any and not self.closing:
            last = self.batches.get(last_batch)
            if not (last is not None and last.rows and not self._seen_all()):
                # The run may end here: what the acknowledgements gave back decides, so wait for them.
                self._wait_acked(last_batch)
        with self._lock:
            last = self.batches.get(last_batch)
            if self.available_now_target is not None:
                if not self.planned_any:
                    return True
                if self.closing:
                    return False
                if last is None or last.rows == 0:
                    # An empty poll can be a slow broker, not an empty queue: go on (a few times) while a
                    # partition this run has been reading still has records below the start's watermark.
                    self.empty_streak += 1
                    target = self.available_now_target
                    behind = [tp for tp, seen in self.max_seen.items() if seen < target.get(tp, 0) - 1]
                    due = bool(behind) or self.redeliveries_due > 0
                    return due and self.empty_streak <= AVAILABLE_NOW_EMPTY_RETRIES
                self.empty_streak = 0
                target = self.available_now_target
                # Stop at once when every record below the start's watermarks has been seen (saves the
                # empty batch that would otherwise prove it), or once a batch brought only newer records.
                if self.redeliveries_due == 0 and self._seen_all():
                    self.closing = True
                    return True
                return any(lo < target.get(tp, 0) for tp, lo in last.min_offsets().items())
            if not self.planned_any:
                return True
            if last is not None and (last.rows or last.outcome.released or last.outcome.failed
                                     or last.outcome.expired):
                self.idle = False
                return True
            self.idle = True
            if self.metadata.version != self.last_plan_hw_version:
                return True
            return time.monotonic() - self.last_plan_time >= self.opts.idle_probe_ms / 1000.0

    def plan(self, batch: int, max_records: Optional[int]) -> Optional[BatchState]:
        """Create ``batch`` (from latestOffset only: the one place a batch that reads is made) and start
        its polls; None once the query is stopping."""
        with self._lock:
            if self.stopping:
                return None
            b = self.batches.get(batch)
            new = b is None
            if new:
                slots = 0 if self.closing else self.slots_for(max_records)
                b = self.batches[batch] = BatchState(batch, slots, max_records)
            self.planned_any = True
            self.last_plan_time = time.monotonic()
            self.last_plan_hw_version = self.metadata.version
        if new and b.slots:
            self._prefetch(b)
        return b

    def batch_to_read(self, batch: int) -> Optional[BatchState]:
        """The batch Spark wants read tasks for, or None when it must read nothing: a batch this run did
        not plan (after a restart Spark replays the last batch of the earlier run, whose records were
        released: new records under its id would be ACCEPTed although an idempotent sink skips the
        replayed id), or any batch once the query is stopping."""
        with self._lock:
            b = self.batches.get(batch)
            if b is None:
                b = self.batches[batch] = BatchState(batch, 0, None, state="void")
                log.warning("spark-share batch %d was planned by an earlier run of this query: Spark replays it, "
                            "and it reads nothing (the records that run held were released; they come back in "
                            "later batches)", batch)
            if self.stopping or b.state != "planned":
                return None
            return b

    def _prefetch(self, b: BatchState) -> None:
        """Ask each agent to start the polls of ``b`` now, as many as it read slots of the last
        batch that was read (its read tasks will likely land there again)."""
        with self._lock:
            read = [x for n, x in sorted(self.batches.items()) if n < b.batch and x.claims]
            if not read:
                return
            per_agent: Dict[str, int] = {}
            for agent_id in read[-1].claims.values():
                per_agent[agent_id] = per_agent.get(agent_id, 0) + 1
            conns = {a: self.agents.get(a) for a in per_agent}
        budget = self.slot_budgets(b)[0]
        for agent_id, n in per_agent.items():
            if conns[agent_id] is not None:
                conns[agent_id].call_async({"op": "prefetch", "batch": b.batch, "count": min(n, b.slots),
                                            "max_records": budget, "poll_timeout_ms": self.opts.poll_timeout_ms})

    def slot_budgets(self, b: BatchState) -> List[Optional[int]]:
        per_slot = None if b.max_records is None else max(1, b.max_records // max(1, b.slots))
        if self.lock_safe_records is not None:
            per_slot = self.lock_safe_records if per_slot is None else min(per_slot, self.lock_safe_records)
        return [per_slot] * b.slots

    # acknowledgements ---------------------------------------------------------------------
    def batch_committed(self, upto: int, wait: bool = True) -> None:
        """Spark has committed every batch <= ``upto``: acknowledge them (ACCEPT unless a verdict
        says otherwise), through the agents that acquired the records."""
        with self._lock:
            self.committed_upto = max(self.committed_upto, upto)
            if self.stopping:  # shutdown acknowledges what is left, knowing it was committed
                todo = []
            else:
                todo = [b for n, b in sorted(self.batches.items()) if n <= upto and b.state == "planned"]
            for b in todo:
                b.state = "acking"
                b.committed_at = time.time()
        for b in todo:
            self._acknowledge(b, ACCEPT)
        # Another thread (the commit listener) may be sending some of them: they must be queued on
        # the consumers before a poll of the next batch can be.
        self._wait_acked(upto, ("acking",))
        if wait:
            self._wait_acked(upto)
        if self.failure:
            raise SourceError(self.failure)

    def _wait_acked(self, upto: int, pending=("acking", "queued"), timeout: Optional[float] = None) -> None:
        """Until no batch <= ``upto`` is in a ``pending`` state (bounded by the ack timeout)."""
        with self._acked:
            self._acked.wait_for(lambda: all(b.state not in pending for n, b in self.batches.items() if n <= upto),
                                 timeout=self.opts.ack_timeout_ms / 1000.0 + 5 if timeout is None else timeout)

    def _acknowledge(self, b: BatchState, default: int) -> None:
        """Queue ``b``'s acknowledgements on the agents that hold its records (``default`` unless a verdict
        says otherwise); the broker's answers are collected by the finisher thread."""
        with self._lock:
            holders = {a["agent"] for a in b.acquired.values() if a.get("rows")}
            conns = {a: self.agents.get(a) for a in holders}
            verdicts = [[t, p, o, k] for (t, p, o), (k, _) in b.verdicts.items()]
            rejects = [[t, p, o, r] for (t, p, o), (k, r) in b.verdicts.items() if k == REJECT]
        timeout_s = self.opts.ack_timeout_ms / 1000.0
        if default == ACCEPT and rejects and self.opts.dead_letter:
            failure = self._write_dead_letters(b, conns, rejects)
            if failure:
                # Nothing of this batch is acknowledged: every record comes back. The query then fails:
                # going on would cycle records towards the broker's delivery limit, which archives them.
                target = (f"deadLetterTopic={self.opts.dead_letter_topic!r}" if self.opts.dead_letter_topic
                          else f"deadLetterPath={self.opts.dead_letter_path!r}")
                log.error("spark-share batch %d: %s; its %d records are released and will be delivered again",
                          b.batch, failure, b.rows)
                b.outcome.errors["DEADLETTER_WRITE_FAILED"] = len(rejects)
                self.failure = (f"the dead-letter target ({target}) could not be written: {failure}. Nothing of "
                                f"batch {b.spark_batch if b.spark_batch is not None else b.batch} was acknowledged; "
                                "its records were released and come back when the query is restarted after the "
                                "target is fixed")
                default, verdicts = RELEASE, []
        queued = {}
        for agent_id, conn in conns.items():
            if conn is None:
                self._count_failed(b, agent_id, AGENT_LOST)
                continue
            try:
                # Returns once the agent has queued the acknowledgement on each consumer, ahead of
                # any later poll of it: the broker's answers are collected off Spark's path.
                conn.call({"op": "ack", "batch": b.batch, "verdicts": verdicts, "default": default,
                           "timeout_s": timeout_s}, timeout=timeout_s + 10)
                queued[agent_id] = conn
            except ConnectionError:  # the agent went away: the broker releases what it held
                self._count_failed(b, agent_id, AGENT_LOST)
            except Exception as e:
                self._count_failed(b, agent_id, type(e).__name__)
        with self._lock:
            # Submitted before the state leaves "acking": shutdown waits for that, then stops the finisher.
            self._finisher.submit(self._finish_ack, b, default, queued, timeout_s)
            b.state = "queued"
            self._acked.notify_all()

    def _count_failed(self, b: BatchState, agent_id: str, why: str) -> None:
        n = sum(a["rows"] for a in b.acquired.values() if a["agent"] == agent_id)
        b.outcome.failed += n
        b.outcome.errors[why] = b.outcome.errors.get(why, 0) + n

    def _finish_ack(self, b: BatchState, default: int, queued: dict, timeout_s: float) -> None:
        """Collect what the broker answered to the acknowledgements of ``b`` and account for them.
        Runs on one thread, so batches finish in the order they were acknowledged."""
        futs = {a: c.call_async({"op": "ack_result", "batch": b.batch}) for a, c in queued.items()}
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
            b.state = "acked" if default == ACCEPT else "released"
            self.totals.add(b.outcome)
            if self.available_now_target is not None:
                self.redeliveries_due += b.outcome.released + b.outcome.failed + b.outcome.expired
            if b.outcome.expired:
                # The batch outlived the record lock: halve what one consumer may take per batch.
                held = b.held_ms()
                if held is not None and held < self.lock_ms:
                    self.lock_ms = held  # the lock is shorter than this
                biggest = max((a.get("rows", 0) for a in b.acquired.values()), default=1)
                cap = max(1, biggest // 2)
                if self.lock_safe_records is None or cap < self.lock_safe_records:
                    self.lock_safe_records = cap
            finished = sorted(n for n, x in self.batches.items() if x.state in ("acked", "released", "void"))
            for n in finished[:-KEEP_FINISHED]:
                del self.batches[n]
            self._acked.notify_all()
        self._log_batch(b)

    def _write_dead_letters(self, b: BatchState, conns: dict, rejects: list) -> Optional[str]:
        """Phase one of acknowledging a batch with rejects: each live agent writes the rejected records it
        holds to the dead-letter target. An agent that is gone wrote nothing and acknowledges nothing: its
        records come back from the broker (counted failed), to be rejected again then. Returns why a write
        failed, or None."""
        held: Dict[str, list] = {}
        with self._lock:
            for r in rejects:
                agent_id = b.holder(r[0], int(r[1]), int(r[2]))
                if agent_id is not None:
                    held.setdefault(agent_id, []).append(r)
        futs = {a: conns[a].call_async({"op": "deadletter", "batch": b.batch, "records": mine})
                for a, mine in held.items() if conns.get(a) is not None}
        for agent_id, f in futs.items():
            try:
                rep, _ = f.result(timeout=120)
            except ConnectionError:
                continue  # lost meanwhile: its acknowledgement fails too, its records come back
            except Exception as e:
                return f"writing dead letters failed on {agent_id}: {scrub(str(e), self._secrets)}"
            if int(rep["written"]) != len(held[agent_id]):
                return (f"only {rep['written']} of the {len(held[agent_id])} rejected records held by {agent_id} were "
                        "found to write as dead letters")
        return None

    def _log_batch(self, b: BatchState) -> None:
        o = b.outcome
        held = b.held_ms()
        lat = f", ack latency {1000 * (b.acked_at - b.committed_at):.0f} ms" if b.committed_at else ""
        lat += f", held {held:.0f} ms" if held is not None else ""
        log.info("spark-share batch %d (group %s): acquired %d, accepted %d, released %d, rejected %d, "
                 "expired %d, failed %d%s%s", b.batch, self.opts.group_id, b.rows, o.accepted, o.released,
                 o.rejected, o.expired, o.failed, lat, f", errors {o.errors}" if o.errors else "")
        if o.expired:
            log.warning("spark-share batch %d: %d records' locks expired before the batch committed; they are "
                        "delivered again. Raise the group's share.record.lock.duration.ms or lower "
                        "maxRecordsPerTrigger so batches finish within the lock; next batches take at most %d "
                        "records per consumer", b.batch, o.expired, self.lock_safe_records)
        elif held is not None and held > LOCK_WARN_FRACTION * self.lock_ms:
            log.warning("spark-share batch %d held its records for %.0f ms, close to the record lock (%.0f ms "
                        "as far as spark-share knows); raise the group's share.record.lock.duration.ms or lower "
                        "maxRecordsPerTrigger before locks expire", b.batch, held, self.lock_ms)

    # progress -----------------------------------------------------------------------------
    def progress(self) -> dict:
        with self._lock:
            planned = max(self.batches) if self.batches else None
            inflight = sum(b.rows for b in self.batches.values() if b.state in ("planned", "acking", "queued"))
            done = [b for b in self.batches.values() if b.state in ("acked", "released")]
            last = max(done, key=lambda b: b.batch).summary() if done else None
            t = self.totals
        headroom = None
        if last is not None and last.get("holdMs") is not None:
            headroom = round(self.lock_ms - last["holdMs"], 1)
        return {"v": 1, "batch": planned, "inflightRecords": inflight, "agents": len(self.agents),
                "maxRecordsPerConsumer": self.lock_safe_records, "lockDurationMs": self.lock_ms,
                "lockHeadroomMs": headroom,
                "acquired": self.total_acquired, "accepted": t.accepted, "released": t.released,
                "rejected": t.rejected, "expired": t.expired, "failed": t.failed,
                "lastAcked": last}

    def status(self) -> dict:
        out = self.progress()
        with self._lock:
            out["batches"] = [b.summary() for _, b in sorted(self.batches.items())[-20:]]
            out["sessions"] = sorted({a.get("session") for b in self.batches.values() for a in b.acquired.values()
                                      if a.get("session")})
        return out

    # shutdown -----------------------------------------------------------------------------
    def _in_commit_log(self, b: BatchState) -> bool:
        return bool(self.commit_log and b.spark_batch is not None
                    and os.path.exists(os.path.join(self.commit_log, str(b.spark_batch))))

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
            pending = [b for _, b in sorted(self.batches.items()) if b.state == "planned"] if first else []
            for b in pending:
                b.state = "acking"
        if not first:
            self._stopped.wait(3 * SHUTDOWN_WAIT_S)
            return
        try:
            self._learn_commit_log()
            for b in pending:
                if b.batch <= self.committed_upto or self._in_commit_log(b):
                    b.committed_at = time.time()
                    self._acknowledge(b, ACCEPT)
                else:
                    self._acknowledge(b, RELEASE)
            if self.batches:
                # Batches another thread is acknowledging are queued first, then the broker answers.
                self._wait_acked(max(self.batches), ("acking",), timeout=SHUTDOWN_WAIT_S)
                self._wait_acked(max(self.batches), timeout=SHUTDOWN_WAIT_S)
            self._finisher.shutdown(wait=False)
            with self._lock:
                conns = list(self.agents.values())
            # Closing its consumers releases whatever an agent still holds.
            for c in conns:
                c.call_async({"op": "shutdown"})
            deadline = time.monotonic() + SHUTDOWN_WAIT_S
            for c in conns:
                c.wait_closed(max(0.0, deadline - time.monotonic()))
            self.server.close()
            self.metadata.close()
            if self._registry_path:
                try:
                    os.unlink(self._registry_path)
                except OSError:
                    pass
            log.info("spark-share tracker %s stopped: %s", self.tracker_id, json.dumps(self.progress()))
            self._close_log()
        finally:
            self._stopped.set()

    def _close_log(self) -> None:
        logging.getLogger("spark_share").removeHandler(self._log_file)
        self._log_file.close()

