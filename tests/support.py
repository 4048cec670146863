"""Test support for kafka-share queries: workloads with unique ids, the no-loss checker, and
helpers to find (and kill) the processes a query runs on."""
from __future__ import annotations

import glob
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
from confluent_kafka import AcknowledgeType, Producer, ShareConsumer

from helpers import wait_until  # also re-exported for the source tests


class Workload:
    """Produces JSON records {"id": n, ...} with unique ids, keyed by id, round-robin over partitions.

    The producer stays open for the workload's life: with the embedded broker, a client that
    disconnects ends every share session on that broker."""

    def __init__(self, kafka, topic: str, partitions: int = 2, create: bool = True):
        self.topic = topic
        self.partitions = partitions
        if create:
            kafka.create_topic(topic, partitions)
        self.producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 5,
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


def ids_of(rows: Iterable) -> list[int]:
    return [json.loads(bytes(r["value"]))["id"] for r in rows]


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


def drain_share_group(bootstrap: str, group: str, topics: list[str], timeout: float,
                      ack=AcknowledgeType.ACCEPT, until: int | None = None, **config) -> list:
    """Consume what a share group hands out within ``timeout`` s (or until ``until`` records);
    ``config``: more consumer configs, dots as underscores (``max_poll_records=100``)."""
    c = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": group, "share.acknowledgement.mode": "explicit",
                       **{k.replace("_", "."): str(v) for k, v in config.items()}})
    c.subscribe(topics)
    got = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and (until is None or len(got) < until):
            msgs = c.poll(min(0.5, max(0.01, deadline - time.monotonic())))
            for m in msgs:
                if m.error() is None:
                    got.append((m.topic(), m.partition(), m.offset(), m.delivery_count(), m.value()))
                    c.acknowledge(m, ack)
            if msgs:
                c.commit_sync(10)
    finally:
        c.close()
    return got


def agent_processes(tracker_id: str | None = None) -> list[psutil.Process]:
    """Live spark-share agents (optionally of one tracker) on this machine."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = p.info["cmdline"] or []
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if "spark_share.agent" in cmd:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if tracker_id is not None:
        out = [p for p in out if _agent_tracker(p) == tracker_id]
    return out


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
    """The log of the tracker that served query ``q`` (logs of other runs are left alone)."""
    from spark_share.runtime import runtime_dir

    for path in glob.glob(os.path.join(runtime_dir(), "tracker-*.log")):
        text = open(path).read()
        if f"serves query {q.id}" in text:
            return text
    raise AssertionError(f"no tracker log names query {q.id}")


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
    from spark_share.runtime import runtime_dir

    try:
        with open(os.path.join(runtime_dir(), f"query-{query_id}.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def read_stream(spark, kafka, group: str, topics, **options):
    r = (spark.readStream.format("kafka-share")
         .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
         .option("kafka.group.id", group)
         .option("subscribe", topics if isinstance(topics, str) else ",".join(topics)))
    for k, v in options.items():
        r = r.option(k, str(v))
    return r.load()
