"""What the tests share: unique ids, bounded waits, workloads with unique ids and the no-loss checker,
a long-lived producer, the embedded broker's share-group membership (ctypes), and helpers to find
(and kill) the processes a query runs on.

``kafka`` here is the test's broker (tests/harness/brokers.py): topic names come back from its
``create_topic``, and every client is built from its ``client()`` (credentials of a cluster of yours
included), never from ``bootstrap_servers`` alone.

Nothing here sleeps to synchronise: ``wait_until`` polls a predicate with a deadline.
"""
from __future__ import annotations

import ctypes
import glob
import itertools
import json
import os
import re
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psutil
import pytest
from confluent_kafka import AcknowledgeType, Producer, ShareConsumer

import spark_share
from spark_share.runtime import ABSTRACT_PREFIX


class Workload:
    """Produces JSON records {"id": n, ...} with unique ids, keyed by id, round-robin over partitions.
    ``topic`` is the real name: created here (its name as the broker gives it), or ``create=False``
    for a topic the test created.

    The producer stays open for the workload's life: with the embedded broker, a client that
    disconnects ends every share session on that broker."""

    def __init__(self, kafka, topic: str, partitions: int = 2, create: bool = True):
        self.topic = kafka.create_topic(topic, partitions) if create else topic
        self.partitions = partitions
        # Idempotent on a real broker: a send retried across a broker restart must not write a record twice.
        self.producer = Producer({**kafka.client(), "linger.ms": 5, "enable.idempotence": bool(kafka.external),
                                  "log_level": 2})  # quiet after the broker is gone: callbacks may outlive tests
        self.ids: list[int] = []
        self._next = 0

    def produce(self, n: int, value_fn=None) -> list[int]:
        new = list(range(self._next, self._next + n))
        for i in new:
            value = value_fn(i) if value_fn else json.dumps({"id": i, "payload": "x" * 20}).encode()
            self.producer.produce(self.topic, key=str(i).encode(), value=value, partition=i % self.partitions)
            self.producer.poll(0)
        self.producer.flush(30)
        self._next += n
        self.ids.extend(new)
        return new


class PacedProducer:
    """A workload's producer on its own thread: ``n`` records every ``every`` seconds until ``stop()``,
    which returns what it raised (a stream's steady input while a test injects faults)."""

    def __init__(self, workload: Workload, n: int, every: float):
        self.workload, self.n, self.every = workload, n, every
        self._stop = threading.Event()
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="paced-producer", daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every):  # the pace, not synchronisation
                self.workload.produce(self.n)
        except BaseException as e:  # reported by stop()
            self.errors.append(e)

    def start(self) -> PacedProducer:
        self._thread.start()
        return self

    def stop(self) -> list[BaseException]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(60)
        return self.errors


def ids_of(rows: Iterable) -> list[int]:
    return [json.loads(bytes(r["value"]))["id"] for r in rows]


def summary_count(text: str, label: str) -> int:
    """A count from the job's printed summary (``  written     1,234``)."""
    m = re.search(rf"^  {label} +([\d,]+)", text, re.M)
    assert m, f"no '{label}' in the summary:\n{text}"
    return int(m.group(1).replace(",", ""))


@dataclass
class NoLossReport:
    produced: int
    delivered: int
    duplicates: int
    lost: int
    lost_ids: list[int] = field(default_factory=list)
    reason: str = ""

    def __str__(self):
        return (f"produced {self.produced} / delivered {self.delivered} / duplicates {self.duplicates} / "
                f"lost {self.lost}" + (f" ({self.reason})" if self.reason else ""))


def check_no_loss(produced: Iterable[int], delivered: Iterable[int], rejected: Iterable[int] = (),
                  duplicates_reason: str = "") -> NoLossReport:
    """Every produced id must be in the sink or the dead-letter target. Duplicates are counted; the
    caller says which fault explains them (and asserts on the count where none is allowed)."""
    produced = list(produced)
    seen = Counter(delivered)
    seen.update(rejected)
    lost = sorted(set(produced) - set(seen))
    dups = sum(c - 1 for c in seen.values() if c > 1)
    report = NoLossReport(len(produced), sum(seen.values()), dups, len(lost), lost[:20], duplicates_reason)
    print("no-loss:", report)
    assert not lost, f"lost {len(lost)} records, e.g. ids {lost[:20]}: {report}"
    unknown = set(seen) - set(produced)
    assert not unknown, f"rows with ids that were never produced: {sorted(unknown)[:20]}"
    return report


class BatchCollector:
    """A foreachBatch function that keeps every row it saw, per batch, in this (the driver) process."""

    def __init__(self, fail_batches: Iterable[int] = (), after=None):
        self.rows: list = []
        self.batches: dict[int, list] = {}
        self.fail_batches = set(fail_batches)
        self.after = after
        self.lock = threading.Lock()

    def __call__(self, df, batch_id):
        rows = df.collect()
        with self.lock:
            self.batches.setdefault(batch_id, []).extend(rows)
            self.rows.extend(rows)
        if self.after:
            self.after(df, batch_id, rows)
        if batch_id in self.fail_batches:
            self.fail_batches.discard(batch_id)
            raise RuntimeError(f"injected failure after writing batch {batch_id}")

    @property
    def ids(self) -> list[int]:
        with self.lock:
            return ids_of(self.rows)

    def has_all(self, ids: Iterable[int]) -> bool:
        """Whether every one of ``ids`` reached the sink; a row count cannot say so once duplicates are allowed."""
        return set(ids) <= set(self.ids)


def client_config(kafka) -> dict[str, str]:
    """Client configs for ``kafka``: the test's broker, or a bootstrap address."""
    return {"bootstrap.servers": kafka} if isinstance(kafka, str) else kafka.client()


def kafka_options(kafka) -> dict[str, str]:
    """The broker's client configs as the source's ``kafka.*`` options."""
    return {f"kafka.{k}": v for k, v in client_config(kafka).items()}


# The readMode of the running test (``both_read_modes`` tests run once per mode: tests/integration/conftest.py);
# read_stream and source_options pass it unless a test gives readMode itself.
READ_MODE = "executors"


def source_options(kafka, group: str, topics, **options) -> dict[str, str]:
    """The options of ``format("kafka-share")`` on the test's broker, as Spark hands them to the source."""
    return {**kafka_options(kafka), "kafka.group.id": group,
            "subscribe": topics if isinstance(topics, str) else ",".join(topics),
            **{k: str(v) for k, v in {"readMode": READ_MODE, **options}.items()}}


@dataclass
class DrivenRun:
    rows: list[dict]  # every row the read tasks yielded, in order
    status: dict  # the tracker's status() once the run ended, before its stop
    log: str  # the tracker's log


def drive_available_now(options: dict[str, str], timeout: float) -> DrivenRun:
    """A Trigger.AvailableNow run of ``format("kafka-share")`` whose driver-side calls and read tasks
    this process makes itself, in Spark's order (initialOffset, prepareForTriggerAvailableNow, then
    latestOffset -> partitions -> read() of each until latestOffset returns its start; a batch counts
    as committed when the next latestOffset comes), then stop(). The tracker runs here, so a test may
    patch its constants; the agent is its own process, as under Spark."""
    from spark_share import runtime
    from spark_share.options import parse_options
    from spark_share.reader import ShareStreamReader

    reader = ShareStreamReader(parse_options(options))
    rows: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        while True:
            assert time.monotonic() < deadline, f"the run did not end within {timeout} s ({len(rows)} rows read)"
            end = reader.latestOffset(start, reader.getDefaultReadLimit())
            if end == start:
                break
            for part in reader.partitions(start, end):
                for rb in reader.read(part):
                    rows.extend(rb.to_pylist())
            start = end
        tracker = reader._tracker
        status = tracker.status()
    finally:
        reader.stop()
    return DrivenRun(rows, status, open(runtime.tracker_log_path(tracker.tracker_id)).read())


def drain_share_group(kafka, group: str, topics: list[str], timeout: float,
                      ack=AcknowledgeType.ACCEPT, until: int | None = None, **config) -> list:
    """Consume what a share group hands out within ``timeout`` s (or until ``until`` records);
    ``kafka``: the test's broker (or a bootstrap address); ``config``: more consumer configs, dots
    as underscores (``max_poll_records=100``).

    A check that nothing is left (no ``until``, nothing handed out yet) ends sooner: once this consumer holds
    every partition of ``topics`` and the broker answered a fetch for all of them with nothing. What is
    available comes in that answer; a record still locked by a member that is gone would not come within
    these few seconds anyway."""
    from spark_share.consumers.session_stats import FetchStats

    stats = FetchStats()
    c = ShareConsumer({**client_config(kafka), "group.id": group, "share.acknowledgement.mode": "explicit",
                       "statistics.interval.ms": 100, "stats_cb": stats.on_stats,
                       **{k.replace("_", "."): str(v) for k, v in config.items()}})
    c.subscribe(topics)
    got = []
    started = time.monotonic()
    deadline = started + timeout
    base: dict[str, int] = {}
    try:
        while time.monotonic() < deadline and (until is None or len(got) < until):
            msgs = c.poll(min(0.5, max(0.01, deadline - time.monotonic())))
            for m in msgs:
                if m.error() is None:
                    got.append((m.topic(), m.partition(), m.offset(), m.delivery_count(), m.value()))
                    c.acknowledge(m, ack)
            if msgs:
                c.commit_sync(10)
            elif until is None and not got and _answered_empty(stats, started, base, topics):
                break
    finally:
        c.close()
    return got


def _answered_empty(stats, started: float, base: dict, topics: list[str]) -> bool:
    """Does this consumer hold every partition of ``topics``, and has the broker answered a fetch for them
    all, sent after ``started``, with nothing?"""
    answered = stats.drained(started, base)
    if not answered:
        return False
    try:
        every = {(t, int(p)) for t, tv in json.loads(stats.text).get("topics", {}).items() if t in topics
                 for p in tv["partitions"] if int(p) >= 0}
    except (ValueError, KeyError, TypeError):
        return False
    return bool(every) and every <= answered


class IdleMember:
    """A share consumer of the group that joins, gets partitions, and then is never polled: what a
    member of the query on a host where no read task lands looks like to the broker."""

    def __init__(self, kafka, group: str, topic: str):
        from confluent_kafka import ShareConsumer

        self.stats: dict = {}
        self.consumer = ShareConsumer({**client_config(kafka), "group.id": group,
                                       "share.acknowledgement.mode": "explicit", "statistics.interval.ms": 100,
                                       "stats_cb": lambda s: self.stats.update(json.loads(s))})
        self.consumer.subscribe([topic])
        # Polled only until it is a steady member with partitions, while the topic is still empty.
        wait_until(lambda: not len(self.consumer.poll(0.1)) and self.assigned() > 0, timeout=30,
                   message="the idle member did not join the group")

    def assigned(self) -> int:
        cgrp = self.stats.get("cgrp") or {}
        return cgrp.get("assignment_size", 0) if cgrp.get("join_state") == "steady" else 0

    def close(self) -> None:
        self.consumer.close()


def agent_processes(tracker_id: str | None = None) -> list[psutil.Process]:
    """Live spark-share agents (optionally of one tracker) on this machine."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "spark_share.consumers.agent" in cmd:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if tracker_id is not None:
        out = [p for p in out if _agent_tracker(p) == tracker_id]
    return out


def agent_addresses(tracker_id: str) -> list[str]:
    """The abstract socket names the agents of a query run listen on in this network namespace (each
    executor's agent has its own): what ``endpoints.connect`` takes."""
    prefix = "@" + ABSTRACT_PREFIX + tracker_id + "-"
    with open("/proc/net/unix") as f:
        next(f)
        rows = [line.split() for line in f]
    # Columns: Num RefCount Protocol Flags Type St Inode Path; a listening socket has __SO_ACCEPTCON (0x10000).
    return sorted({"\0" + r[7][1:] for r in rows if len(r) > 7 and r[7].startswith(prefix) and int(r[3], 16) & 0x10000})


def agent_files(spark, pattern: str = "agent-*") -> list[str]:
    """Files of agents in the local dirs of ``spark``'s driver (local mode: its read tasks' executor), and in
    the runtime directory, where a ``SPARK_SHARE_RUNTIME_DIR`` the user set puts them."""
    from spark_share.runtime import runtime_dir

    roots = spark.conf.get("spark.local.dir", "/tmp").split(",")
    return sorted([p for r in roots for p in glob.glob(os.path.join(r, "blockmgr-*", pattern))]
                  + glob.glob(os.path.join(runtime_dir(), pattern)))


def batch_agents(df) -> list[psutil.Process]:
    """The agents of the query whose batch ``df`` is (called inside foreachBatch): other tests'
    agents may still be shutting down."""
    qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    return agent_processes(registry(qid)["tracker_id"])


def _agent_tracker(p) -> str | None:
    try:
        for f in p.open_files():
            name = os.path.basename(f.path)
            if name.startswith("agent-") and name.endswith(".log"):
                return name[len("agent-"):-len(".log")]
    except psutil.Error:
        pass
    return None


def our_processes() -> list[psutil.Process]:
    """Processes this test run started (the Spark JVM and what it forked), never another program's."""
    return psutil.Process().children(recursive=True)


def python_workers() -> list[psutil.Process]:
    """PySpark Python workers forked by this run's pyspark.daemon (not the daemon itself)."""
    out = []
    for p in our_processes():
        try:
            if "pyspark.daemon" in " ".join(p.cmdline()) and "pyspark.daemon" in " ".join(p.parent().cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def workers_talking_to(pids: Iterable[int]) -> list[psutil.Process]:
    """This run's Python workers holding a Unix socket connected to one of ``pids`` (a read in flight talks
    to its host's agent; an idle pooled worker does not). ``ss`` says which socket is whose peer."""
    import subprocess

    wanted = set(pids)
    owners: dict[str, set[int]] = {}
    peer_of: dict[str, str] = {}
    for line in subprocess.run(["ss", "-xpn"], capture_output=True, text=True, check=True).stdout.splitlines()[1:]:
        m = re.match(r"\S+\s+\S+\s+\d+\s+\d+\s+\S+\s+(\d+)\s+\S+\s+(\d+)\s*(.*)$", line)
        if m:
            owners[m.group(1)] = {int(p) for p in re.findall(r"pid=(\d+)", m.group(3))}
            peer_of[m.group(1)] = m.group(2)
    theirs = {inode for inode, holders in owners.items() if holders & wanted}
    return [w for w in python_workers()
            if any(w.pid in holders and peer_of[inode] in theirs for inode, holders in owners.items())]


def runner_processes() -> list[psutil.Process]:
    """This run's python_streaming_source_runner processes (the trackers live there)."""
    out = []
    for p in our_processes():
        try:
            if any("python_streaming_source_runner" in part for part in p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def tracker_log(q) -> str:
    """The log of the tracker that served query ``q``'s latest run: the one its last progress names, else the
    newest log naming the query (a restarted query has a log per run, all naming it)."""
    from spark_share.offsets import from_progress
    from spark_share.runtime import tracker_log_path

    latest = q.recentProgress[-1]["sources"][0]["endOffset"] if q.recentProgress else None
    run = (from_progress(latest) or {}).get("run") if isinstance(latest, str) else None
    if run and os.path.exists(tracker_log_path(run)):
        return open(tracker_log_path(run)).read()
    naming = query_tracker_logs(str(q.id))
    if not naming:
        raise AssertionError(f"no tracker log names query {q.id}")
    return open(max(naming, key=os.path.getmtime)).read()


def query_tracker_logs(query_id: str) -> list[str]:
    """The paths of the logs of every tracker (every run) that served query ``query_id`` on this host."""
    from spark_share.runtime import runtime_dir

    return [p for p in glob.glob(os.path.join(runtime_dir(), "tracker-*.log"))
            if f"serves query {query_id}" in open(p).read()]


def kill(procs: Iterable[psutil.Process], timeout: float = 15.0) -> int:
    """SIGKILL ``procs`` and return once they are dead: Spark hands a pooled worker to the next task
    if its process still looks alive, so a caller that runs a job right after killing must not race
    the kernel tearing the process down."""
    sent = []
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
            sent.append(p)
        except ProcessLookupError:
            pass

    def dead(p: psutil.Process) -> bool:
        try:
            return p.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_until(lambda: all(dead(p) for p in sent), timeout, message=f"killed processes {[p.pid for p in sent]} to exit")
    return len(sent)


def registry(query_id: str) -> dict | None:
    """The query's registry entry on this host (None once its tracker removed it)."""
    from spark_share.runtime import registry_entry

    return registry_entry(query_id)


def read_stream(spark, kafka, group: str, topics, **options):
    """``format("kafka-share")`` on the test's broker (its client configs as ``kafka.*`` options)."""
    r = (spark.readStream.format("kafka-share").options(**kafka_options(kafka))
         .option("kafka.group.id", group)
         .option("subscribe", topics if isinstance(topics, str) else ",".join(topics)))
    for k, v in {"readMode": READ_MODE, **options}.items():
        r = r.option(k, str(v))
    return r.load()


def uid(prefix: str = "g") -> str:
    """A name no other test uses (groups, topics, queries)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def gid() -> str:
    return uid("g")


def id_col():
    """The ``id`` field of the JSON values Workload produces, as a column."""
    from pyspark.sql import functions as F

    return F.get_json_object(F.col("value").cast("string"), "$.id").cast("long")




def source_progress(q) -> dict:
    """The tracker's counts: the source's part of the query's last progress, or, where Spark reports no
    source counters (< 4.2), what the tracker logged when the query's run stopped."""
    from spark_share.offsets import from_progress

    latest = q.recentProgress[-1]["sources"][0]["latestOffset"] if q.recentProgress else None
    latest = from_progress(latest) if isinstance(latest, str) else latest
    if isinstance(latest, dict) and "tracker" in latest:
        return latest

    def stopped():
        found = re.findall(r"spark-share tracker \w+ stopped: (\{.*\})", tracker_log(q))
        return json.loads(found[-1]) if found else None

    return wait_until(stopped, timeout=30, message=f"the tracker of query {q.id} logged no final counts")


def long_trigger(at_least_s: int = 60, quiet_s: int = 300) -> str:
    """A processingTime interval of ``at_least_s`` or more whose next trigger is ``quiet_s`` or more away. Spark
    starts a trigger at the next multiple of its interval since the epoch (``ProcessingTimeExecutor.nextBatchTime``),
    not an interval after the last batch: under a plain 60 s trigger the second batch may start a second after the
    first, and a test about what happens before the next trigger then judges the wrong batch."""
    now, n = time.time(), max(at_least_s, quiet_s)
    while n - now % n < quiet_s:
        n += 1
    return f"{n} seconds"


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition not met"):
    """Call ``predicate`` until it returns something truthy (returned) or ``timeout`` s pass
    (AssertionError naming ``message``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (waited {timeout} s)")
        time.sleep(interval)  # polling interval of a bounded wait, not synchronisation


class ProducerPool:
    """One long-lived confluent-kafka Producer per broker for the life of a test.

    With the embedded broker, ANY client disconnecting ends every share session on that broker
    (locked records of other consumers are released and delivered again), so a test must not
    create and drop producers while share consumers are working. ``close()`` at the end of the
    test flushes and drops them, before the broker itself goes away (a producer outliving its
    broker could otherwise reconnect to a later test's broker that reuses the port)."""

    def __init__(self):
        self._producers: dict[str, object] = {}
        self._ids = itertools.count()

    def producer(self, kafka):
        from confluent_kafka import Producer

        config = client_config(kafka)
        p = self._producers.get(config["bootstrap.servers"])
        if p is None:
            p = self._producers[config["bootstrap.servers"]] = Producer({**config, "linger.ms": 2, "log_level": 2})
        return p

    def produce(self, kafka, topic: str, values_or_count: int | Iterable, partitions: int | None = None,
                timeout: float = 30.0) -> list[int]:
        """Produce records with ids unique within the test: value = JSON with an ``id`` field,
        key = the id. ``values_or_count`` is a count or an iterable of values (dicts get an ``id``
        unless they have one; anything else is stored under ``value``). ``partitions=N`` spreads
        the records round-robin over partitions 0..N-1 (else the key decides). Flushes; returns
        the ids in production order."""
        p = self.producer(kafka)
        values = [None] * values_or_count if isinstance(values_or_count, int) else list(values_or_count)
        ids = []
        for i, v in enumerate(values):
            if isinstance(v, dict) and "id" in v:
                rid = v["id"]
                body = v
            else:
                rid = next(self._ids)
                body = {"id": rid, **v} if isinstance(v, dict) else ({"id": rid} if v is None else {"id": rid, "value": v})
            kwargs = {} if partitions is None else {"partition": i % partitions}
            while True:
                try:
                    p.produce(topic, key=str(rid).encode(), value=json.dumps(body).encode(), **kwargs)
                    break
                except BufferError:
                    p.poll(0.1)
            ids.append(rid)
        left = p.flush(timeout)
        assert left == 0, f"{left} records not delivered to {topic} within {timeout} s"
        return ids

    __call__ = produce

    def close(self) -> None:
        for p in self._producers.values():
            p.flush(5)
        self._producers.clear()


# --- share-group membership of the embedded broker ----------------------------------------
class ShareGroups:
    """Member ids and manual target assignment of the embedded broker's share groups.

    The mock's own assignor gives each partition to ONE member. ``assign`` calls
    ``rd_kafka_mock_sharegroup_target_assignment`` to put a partition on several members (what
    a real broker does); it switches the group to manual assignment for good. It goes through
    its own ctypes handle on the library EmbeddedKafka loaded, so EmbeddedKafka's function
    prototypes are untouched."""

    _lib = None

    def __init__(self, kafka):
        from spark_share.embedded import EmbeddedKafka

        if not isinstance(kafka, EmbeddedKafka):
            pytest.skip("needs the embedded broker's share-group membership (ctypes): not available on an "
                        "external cluster")
        self.kafka = kafka
        if ShareGroups._lib is None:
            from spark_share.embedded import _find_librdkafka, _load

            _load()  # the same checks (and error message) as EmbeddedKafka
            lib = ctypes.CDLL(_find_librdkafka())
            PP_char = ctypes.POINTER(ctypes.POINTER(ctypes.c_char_p))
            for name, args, res in (
                ("rd_kafka_mock_sharegroup_get_member_ids",
                 [ctypes.c_void_p, ctypes.c_char_p, PP_char, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
                ("rd_kafka_mock_sharegroup_target_assignment",
                 [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                  ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], None),
                ("rd_kafka_topic_partition_list_new", [ctypes.c_int], ctypes.c_void_p),
                ("rd_kafka_topic_partition_list_add", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32],
                 ctypes.c_void_p),
                ("rd_kafka_topic_partition_list_destroy", [ctypes.c_void_p], None),
                ("rd_kafka_mem_free", [ctypes.c_void_p, ctypes.c_void_p], None),
            ):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            ShareGroups._lib = lib
        self.lib = ShareGroups._lib

    def _mc(self):
        mc = self.kafka._mc
        assert mc, "the embedded broker is closed"
        return mc

    def members(self, group: str) -> list[str]:
        """Member ids of ``group`` ([] if the group does not exist yet)."""
        arr = ctypes.POINTER(ctypes.c_char_p)()
        n = ctypes.c_size_t()
        rc = self.lib.rd_kafka_mock_sharegroup_get_member_ids(self._mc(), group.encode(), ctypes.byref(arr),
                                                             ctypes.byref(n))
        if rc:  # GROUP_ID_NOT_FOUND
            return []
        out = [arr[i].decode() for i in range(n.value)]
        if n.value:
            raw = ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))
            for i in range(n.value):
                self.lib.rd_kafka_mem_free(None, raw[i])
            self.lib.rd_kafka_mem_free(None, ctypes.cast(arr, ctypes.c_void_p))
        return out

    def assign(self, group: str, assignment: dict[str, Sequence[tuple[str, int]]]) -> None:
        """Give each member id exactly the (topic, partition)s listed (freezes the group's assignment)."""
        ids = list(assignment)
        lists = []
        try:
            for m in ids:
                tpl = self.lib.rd_kafka_topic_partition_list_new(max(1, len(assignment[m])))
                lists.append(tpl)
                for topic, part in assignment[m]:
                    self.lib.rd_kafka_topic_partition_list_add(tpl, topic.encode(), part)
            self.lib.rd_kafka_mock_sharegroup_target_assignment(
                self._mc(), group.encode(), (ctypes.c_char_p * len(ids))(*[m.encode() for m in ids]),
                (ctypes.c_void_p * len(ids))(*lists), len(ids))
        finally:
            for tpl in lists:
                self.lib.rd_kafka_topic_partition_list_destroy(tpl)


def broker_outage(kafka, seconds: float) -> threading.Thread:
    """Take the test's broker away now and bring it back after ``seconds``, in the thread returned (join
    it): the embedded broker's down/up, or a clean stop and a start, on the same data directory, of the
    real broker the harness started (a cluster of yours skips the test)."""
    if kafka.external:
        node = kafka.broker_kit().nodes[0]
        node.stop()
        back = node.start
    else:
        kafka.broker_down(1)

        def back():
            kafka.broker_up(1)
    t = threading.Timer(seconds, back)
    t.start()
    return t


def run_available_now(spark, kafka, group, topics, foreach, ckpt, **options):
    q = spark_share.drain(read_stream(spark, kafka, group, topics, **options).writeStream.foreachBatch(foreach)
         .option("checkpointLocation", ckpt))
    assert q.awaitTermination(180), "AvailableNow run did not end"
    return q


def parquet_rows(path, columns) -> list[dict]:
    import pyarrow.parquet as pq

    files = glob.glob(os.path.join(str(path), "**", "*.parquet"), recursive=True)
    return [r for f in files for r in pq.read_table(f, columns=columns).to_pylist()]


def check_tens_rejected(kafka, group: str, topic: str, ids: list[int], out: str, seen: dict) -> None:
    """A drain whose foreachBatch rejected every id divisible by ten (reason "tens", dead-lettered to
    ``out``-dlq) and wrote the others to ``out``, run by a program that asked ``status()`` at its end and
    said what it got in ``seen``: every id written or dead-lettered once, 0 lost, nothing left queued, and
    the status from the query's progress (Spark >= 4.2; before, an error that says why)."""
    from spark_share import spark_versions

    dead = {json.loads(bytes(r["value"]))["id"]: r["reason"] for r in parquet_rows(str(out) + "-dlq", ["value", "reason"])}
    assert dead == {i: "tens" for i in ids if i % 10 == 0}
    written = ids_of(parquet_rows(out, ["value"]))
    assert sorted(written) == sorted(i for i in ids if i % 10 != 0), "a written row is missing or twice"
    check_no_loss(ids, written, list(dead))
    assert drain_share_group(kafka, group, [topic], timeout=3) == [], "records left behind"
    if spark_versions.ADMISSION_CONTROL:
        status = seen.get("status") or {}
        assert status.get("view") == "lastProgress" and status.get("rejected") == len(dead) and \
            status.get("accepted") == len(written), seen
    else:  # Spark < 4.2: the progress carries no source counters, and the error says where to look
        assert "reports no source counters" in seen.get("statusError", ""), seen
