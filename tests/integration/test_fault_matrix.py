"""The fault matrix (README, "Guarantees and failure modes"): each row injects one fault and checks
that nothing is lost.

Rows 1-12 and the verdict rows run a query on both brokers (the embedded one, and real Kafka in the
real pass, where the rows that inject errors, 7 and 8, are skipped and row 9's outage is a stop and a
start of the broker) and print "no-loss: produced N / delivered N / duplicates N / lost 0", saying
which fault explains the duplicates. Rows 13-17 are
the replay, zombie-read and stop-race rows: a batch id that cannot be served with its first rows
acquires nothing, and SIGTERM at any phase ACCEPTs what Spark committed and RELEASEs the rest. The
last tests pin the tracker's refusals that those rows rely on."""
from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import psutil
import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_share
from harness.brokers import EmbeddedBroker
from harness.support import (
    BatchCollector,
    Workload,
    agent_processes,
    batch_agents,
    broker_outage,
    check_no_loss,
    drain_share_group,
    gid,
    id_col,
    ids_of,
    kafka_options,
    kill,
    python_workers,
    read_stream,
    registry,
    run_available_now,
    runner_processes,
    source_progress,
    tracker_log,
    uid,
    wait_until,
)
from spark_share.driver.batches import ACCEPT, REJECT
from spark_share.driver.tracker import AGENT_LOST, Tracker
from spark_share.errors import BatchRefused
from spark_share.options import parse_options
from spark_share.runtime import agent_socket_path
from spark_share.transport.protocol import Acquired, Claim

pytestmark = pytest.mark.slow


HARNESS = os.path.join(os.path.dirname(__file__), "sigterm_harness.py")


class StubAgent(SimpleNamespace):
    """An agent connection for tracker-only tests: records the commands it gets, answers them."""

    def __init__(self, agent_id: str, written=None):
        super().__init__(info={"agent_id": agent_id}, sent=[], closed=False, written=written)

    def call(self, req, blob=b"", timeout=None):
        self.sent.append(req)
        return {"queued": 1}, b""

    def call_async(self, req, blob=b""):
        self.sent.append(req)
        f = Future()
        if req["op"] == "deadletter":
            f.set_result(({"written": len(req["records"]) if self.written is None else self.written}, b""))
        else:
            f.set_result(({"slots": {}}, b""))
        return f

    def wait_closed(self, timeout=None):
        return True


def tracker(kafka, topic, **options) -> tuple[Tracker, str]:
    """A tracker on a new two-partition topic, and the topic's real name."""
    topic = kafka.create_topic(topic, 2)
    return Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()),
                                  "subscribe": topic, **options})), topic


def acquired(t: Tracker, agent, batch: int, slot: int, topic: str, partition: int, first: int, last: int) -> None:
    t._acquired(agent, Acquired(batch, slot, rows=last - first + 1, offsets={topic: {str(partition): [[first, last]]}}))


# --- SIGTERM at each phase -------------------------------------------------------------------------
class Lines:
    """The harness's stdout, line by line, read on a thread (select() cannot see lines already buffered)."""

    def __init__(self, proc):
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(line) for line in proc.stdout] + [self.queue.put("")],
                         daemon=True).start()

    def wait_for(self, prefix: str, timeout: float = 90.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the harness never printed {prefix!r}") from None
            assert line, f"the harness ended before printing {prefix!r}"
            if line.startswith(prefix):
                return line.split()


def sigterm_to_another_thread(pid: int) -> None:
    """SIGTERM to one of ``pid``'s threads other than its main one: the kernel delivers a signal sent
    to a process to any thread that does not block it, and a handler that only the main thread can
    run waits for it to come back from a blocking read (in the runner: the JVM's socket)."""
    import ctypes

    def blocks_sigterm(tid: int) -> bool:  # librdkafka's threads block every signal
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
        return bool(mask & (1 << (signal.SIGTERM - 1)))

    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    tid = next(t for t in sorted(tids) if not blocks_sigterm(t))
    SYS_tgkill = 234  # x86_64
    assert ctypes.CDLL(None, use_errno=True).syscall(SYS_tgkill, pid, tid, signal.SIGTERM) == 0


def test_row1_crash_after_sink_write_redelivers_the_batch(spark, kafka, tmp_path):
    """Invariant 1: nothing is ACCEPTed before the batch is in the commit log."""
    w = Workload(kafka, "payments", partitions=2)
    w.produce(300)
    group, ck = kafka.group(uid("g")), str(tmp_path / "ck")
    out = str(tmp_path / "out")

    def write_then_crash(df, batch_id):
        df.write.mode("append").parquet(out)
        raise RuntimeError("crash after the sink wrote, before the commit")

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(write_then_crash)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="crash after the sink wrote"):
        q.awaitTermination(120)
    first = spark.read.parquet(out).collect()
    assert len(first) > 0 and {r["deliveryCount"] for r in first} == {1}
    assert not os.path.exists(os.path.join(ck, "commits", "0"))

    # Restart from the checkpoint: batch 0 is replayed and every record of it comes back.
    collector = BatchCollector()
    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(collector)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    redelivered = {json.loads(bytes(r["value"]))["id"]: r["deliveryCount"] for r in collector.rows}
    for r in first:
        i = json.loads(bytes(r["value"]))["id"]
        assert redelivered.get(i) == 2, f"record {i} of the failed batch did not come back with deliveryCount 2"
    check_no_loss(w.ids, collector.ids)


def test_row2_stop_mid_batch_releases_at_once_and_leaves_nothing_running(spark, kafka, tmp_path):
    """Invariant 5: q.stop() in the middle of a batch RELEASEs its records; no agent stays behind.
    Then a restart from the checkpoint (replaying the uncommitted batch) delivers everything."""
    kafka.set_record_lock_duration(60_000)  # only a release, not lock expiry, can hand them out in time
    w = Workload(kafka, "jobs", partitions=2)
    w.produce(200)
    group, ck, out = kafka.group(uid("g")), str(tmp_path / "ck"), str(tmp_path / "out")

    @F.udf("long")
    def slow(offset):
        time.sleep(0.05)
        return offset

    df = read_stream(spark, kafka, group, w.topic)
    q = (df.withColumn("o2", slow("offset")).writeStream.format("parquet").option("path", out)
         .option("checkpointLocation", ck).start())
    wait_until(lambda: q.isActive and spark_share.status(q)["inflightRecords"] > 0
               if registry(q.id) else False, timeout=60, message="the batch never started")
    reg = registry(q.id)
    tracker_id = reg["tracker_id"]
    assert agent_processes(tracker_id)
    held = spark_share.status(q)["inflightRecords"]
    t0 = time.monotonic()
    q.stop()
    wait_until(lambda: not agent_processes(tracker_id), timeout=30, message="agent left running after stop")
    wait_until(lambda: not psutil.pid_exists(reg["pid"]), timeout=30, message="the tracker's process outlived the query")
    # Nothing of this process still talks to the tracker (status() and the listener opened connections).
    wait_until(lambda: not [c for c in psutil.Process().net_connections("tcp")
                            if c.raddr and c.raddr.port == reg["port"]], timeout=10,
               message="a connection to the stopped query's tracker was left open")
    # Another member of the group gets the records well before the 60 s lock would expire. (It must
    # join after the query's consumers left: the embedded broker gives a partition to one member.)
    got = drain_share_group(kafka, group, [w.topic], timeout=20, until=200,
                            ack=__import__("confluent_kafka").AcknowledgeType.RELEASE)
    assert len({(t, p, o) for t, p, o, _, _ in got}) >= held, f"only {len(got)} of {held} records released in time"
    assert time.monotonic() - t0 < 40
    assert registry(q.id) is None
    assert not os.path.exists(agent_socket_path(tracker_id))

    # Restart: replays the uncommitted batch and then drains the rest.
    kafka.set_record_lock_duration(30_000)
    q = (read_stream(spark, kafka, group, w.topic).writeStream.format("parquet").option("path", out)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    check_no_loss(w.ids, ids_of(spark.read.parquet(out).collect()),
                  duplicates_reason="rows the stopped batch wrote before the stop")


def test_row3_driver_side_killed_holding_records(spark, kafka, tmp_path):
    """The reader's runner process (the tracker) is SIGKILLed while a batch holds records: the
    agents see their tracker vanish, release everything and exit; a restart recovers all."""
    w = Workload(kafka, "r3", partitions=2)
    w.produce(200)
    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    state = {}

    def kill_runner(df, batch_id):
        df.count()
        state["agents"] = {p.pid for p in batch_agents(df)}
        qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        runner = registry(qid)["pid"]  # the tracker's process: this query's runner
        assert runner in {p.pid for p in runner_processes()}
        state["killed"] = kill([psutil.Process(runner)])

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(kill_runner)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception):
        q.awaitTermination(120)
    assert state["killed"] >= 1 and state["agents"]
    wait_until(lambda: not (state["agents"] & {p.pid for p in agent_processes()}), timeout=30,
               message="agents outlived their tracker")
    collector = BatchCollector()
    q = run_available_now(spark, kafka, group, w.topic, collector, ck)
    assert q.exception() is None
    check_no_loss(w.ids, collector.ids)


def test_row4_python_worker_killed_while_read_waits(spark, kafka, tmp_path):
    """A Python worker is SIGKILLed while its read() waits on the agent's poll: the task is retried
    in a new worker, which gets the same poll's result from the agent."""
    w = Workload(kafka, "r4", partitions=1)
    collector = BatchCollector()
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, pollTimeoutMs=8000).writeStream.foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")).start())

    def polling():
        if not registry(q.id):
            return False
        return any(b.get("polling") for b in spark_share.status(q)["batches"])

    try:
        # A read task waits on the agent's poll (nothing to read yet, an 8 s poll): kill its worker.
        wait_until(polling, timeout=60, message="no read in progress")
        killed = kill(python_workers())
        assert killed >= 1 and polling(), "the read was not in flight when its worker was killed"
        w.produce(100)
        wait_until(lambda: len(collector.rows) >= 100, timeout=60, message="records not delivered")
    finally:
        q.stop()
    report = check_no_loss(w.ids, collector.ids)
    assert report.duplicates == 0


def test_row5_agent_killed_while_holding_records(spark, kafka, tmp_path):
    """The agent is SIGKILLed after the batch was read and before it committed: its records go
    back to the group (released when its connections drop, or when their 10 s locks expire) and are
    delivered again to a new agent. (The new agent's consumers join while one of them may already hold
    records of the next batch: its lock must outlast their join, up to JOIN_GRACE_S.)"""
    kafka.set_record_lock_duration(10_000)
    kafka.set_session_timeout(6000)  # the dead agent's members leave the group (and its partitions) sooner
    w = Workload(kafka, "r5", partitions=2)
    w.produce(200)
    killed = []

    def kill_agent(df, batch_id, rows):
        if batch_id == 0:
            killed.append(kill(batch_agents(df)))

    collector = BatchCollector(after=kill_agent)
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, idleProbeIntervalMs=1000).writeStream
         .foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        wait_until(lambda: collector.has_all(w.ids) and 0 in collector.batches
                   and Counter(collector.ids) >= Counter(2 * ids_of(collector.batches[0])),
                   timeout=60, message="batch 0's records did not all come back after the agent died")
        first = len(collector.batches[0])
        wait_until(lambda: spark_share.status(q)["failed"] == first, timeout=30, message="loss not counted")
    finally:
        q.stop()
    assert killed == [1]
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="batch 0's records, redelivered after the agent died")
    assert report.duplicates == first
    assert "AGENT_LOST" in tracker_log(q)


def test_row6_two_actions_and_a_task_retry_see_the_same_rows(spark, kafka, tmp_path):
    """Invariant 3: re-reads of a batch return the rows first acquired; nothing extra is acquired."""
    w = Workload(kafka, "events", partitions=2)
    w.produce(400)
    seen_dir = tmp_path / "attempts"
    seen_dir.mkdir()

    def fail_first_attempt(batches):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        offsets = []
        out = []
        for b in batches:
            offsets += list(zip(b.column("partition").to_pylist(), b.column("offset").to_pylist()))
            out.append(b)
        path = seen_dir / f"p{ctx.partitionId()}-a{ctx.attemptNumber()}-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(offsets))
        if ctx.attemptNumber() == 0 and offsets:
            # The first attempt of each data-carrying task fails once per action.
            raise RuntimeError("injected task failure downstream of the read")
        yield from out

    counts = {}
    delivered = []

    def two_actions(df, batch_id):
        n = df.count()
        rows = df.collect()
        counts[batch_id] = (n, len(rows), len({(r["partition"], r["offset"]) for r in rows}))
        delivered.extend(ids_of(rows))

    df = read_stream(spark, kafka, kafka.group(uid("g")), w.topic)
    df = df.mapInArrow(fail_first_attempt, df.schema)
    q = (df.writeStream.foreachBatch(two_actions).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert counts and all(n == m == d for n, m, d in counts.values()), counts
    assert sum(n for n, _, _ in counts.values()) == 400
    # Every attempt at a slot of the data batch (2 actions x failed attempt + retry) saw the same rows.
    slots_with_data = 0
    for slot in (0, 1):
        first = [sorted(map(tuple, json.loads(p.read_text()))) for p in seen_dir.glob(f"p{slot}-a0-*.json")]
        retry = [sorted(map(tuple, json.loads(p.read_text()))) for p in seen_dir.glob(f"p{slot}-a1-*.json")]
        first = [f for f in first if f]
        if not first:
            continue
        slots_with_data += 1
        assert len(first) == 2 and len(retry) == 2, "the injected failures and their retries did not all happen"
        assert first[0] == first[1] == retry[0] == retry[1]
    assert slots_with_data >= 1
    progress = q.recentProgress[-1]["sources"][0]["latestOffset"]
    progress = json.loads(progress) if isinstance(progress, str) else progress
    assert progress["acquired"] == 400, "re-reads acquired extra records"
    assert check_no_loss(w.ids, delivered).duplicates == 0


@pytest.mark.embedded_only("injects ShareFetch errors and moves a partition's leader")
@pytest.mark.parametrize("inject", ["retriable", "fatal", "leader_move"])
def test_row7_share_fetch_errors(spark, tmp_path, inject):
    with EmbeddedBroker(brokers=2) as kafka:
        w = Workload(kafka, "r7", partitions=2)
        w.produce(300)
        kafka.track_requests()
        if inject == "retriable":
            kafka.push_request_errors("ShareFetch", [6, 6, 7])  # NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT
        elif inject == "fatal":
            kafka.push_request_errors("ShareFetch", [29])  # TOPIC_AUTHORIZATION_FAILED, once
        moved = []

        def process(df, batch_id):
            collector(df, batch_id)
            if inject == "leader_move" and not moved:
                kafka.move_leader(w.topic, 0, 2)
                moved.append(True)
                w.produce(100)

        collector = BatchCollector()
        q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, process, str(tmp_path / "ck"))
        assert q.exception() is None
        if inject == "leader_move":
            assert moved == [True]
        else:  # the injected errors were served: more ShareFetch requests came than errors were queued
            assert kafka.request_count("ShareFetch") > {"retriable": 3, "fatal": 1}[inject]
        check_no_loss(w.ids, collector.ids, duplicates_reason="share sessions reset by the injected fault")


@pytest.mark.embedded_only("injects ShareAcknowledge errors")
def test_row8_share_acknowledge_errors(spark, kafka, tmp_path):
    """The acknowledgement of batch 0 fails: the records come back, the failure is counted and
    logged with its error code, nothing is lost."""
    w = Workload(kafka, "r8", partitions=1)
    w.produce(100)

    def fail_the_ack(df, batch_id, rows):
        if batch_id == 0:
            kafka.push_request_errors("ShareAcknowledge", [29])

    collector = BatchCollector(after=fail_the_ack)
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, collector, str(tmp_path / "ck"))
    assert q.exception() is None
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="batch 0 came back after its ack failed")
    assert report.duplicates == 100
    assert {r["deliveryCount"] for b, rows in collector.batches.items() if b > 0 for r in rows} == {2}
    p = source_progress(q)
    assert p["failed"] == 100 and p["accepted"] == 100
    assert "'TOPIC_AUTHORIZATION_FAILED(29)': 100" in tracker_log(q)


def test_row9_broker_down_while_records_are_acquired(spark, kafka, tmp_path):
    """The broker goes away for 3 s right after batch 0 wrote (embedded: down/up; real Kafka: a clean
    stop and a start on the same data directory): batch 0's acknowledgement waits for it or fails and
    its records come back; nothing is lost."""
    w = Workload(kafka, "r9", partitions=2)
    w.produce(200)
    timers = []

    def outage(df, batch_id, rows):
        if batch_id == 0:
            timers.append(broker_outage(kafka, 3.0))

    collector = BatchCollector(after=outage)
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, collector, str(tmp_path / "ck"),
                          ackTimeoutMs=10000)
    for t in timers:
        t.join()
    assert q.exception() is None
    # Batch 0's acknowledgement met the outage: it was held until the broker came back, or failed.
    line = re.search(r"spark-share batch 0 \(group [^)]+\): .*", tracker_log(q)).group(0)
    latency = int(re.search(r"ack latency (\d+) ms", line).group(1))
    assert latency >= 1000 or "errors" in line, line
    check_no_loss(w.ids, collector.ids, duplicates_reason="records whose ack was lost with the broker")


def test_row10_batch_outlives_the_lock_and_batches_shrink(spark, kafka, tmp_path):
    """Lock 3 s, processing 10 ms per record: a 400-record batch outlives its lock. The expiry is
    counted and logged with advice, later batches shrink until they fit, nothing is lost."""
    kafka.set_record_lock_duration(3000)
    w = Workload(kafka, "r10", partitions=1)
    w.produce(400)

    def slow(df, batch_id):
        rows = df.collect()
        time.sleep(0.01 * len(rows))  # the work: proportional to the batch
        collector.batches.setdefault(batch_id, []).extend(rows)
        collector.rows.extend(rows)

    collector = BatchCollector()
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, slow, str(tmp_path / "ck"))
    assert q.exception() is None
    sizes = [len(collector.batches[b]) for b in sorted(collector.batches)]
    p = source_progress(q)
    assert p["expired"] >= 1, f"no expiry detected; batch sizes {sizes}"
    assert p["maxRecordsPerConsumer"] is not None and p["maxRecordsPerConsumer"] * 0.01 < 3
    assert max(sizes[1:]) <= p["maxRecordsPerConsumer"] * 2, sizes
    log = tracker_log(q)
    assert "locks expired before the batch committed" in log and "share.record.lock.duration.ms" in log
    expired = [int(n) for n in re.findall(r"spark-share batch \d+ \(group [^)]+\): acquired \d+, accepted \d+, "
                                          r"released \d+, rejected \d+, expired (\d+)", log)]
    assert log.count("locks expired before the batch committed") == sum(1 for n in expired if n), "not once per batch"
    assert expired[-2:] == [0, 0], f"expiries did not stop once batches shrank: {expired}"
    check_no_loss(w.ids, collector.ids, duplicates_reason="records whose lock expired in the first batch")


def test_row11_reexecution_with_persist(spark, kafka, tmp_path):
    w = Workload(kafka, "r11", partitions=2)
    w.produce(200)
    counts = []

    def twice(df, batch_id):
        df.persist()
        counts.append((df.count(), len(df.collect())))
        collector(df, batch_id)
        df.unpersist()

    collector = BatchCollector()
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, twice, str(tmp_path / "ck"))
    assert q.exception() is None
    assert all(a == b for a, b in counts)
    assert check_no_loss(w.ids, collector.ids).duplicates == 0
    assert source_progress(q)["acquired"] == 200


def test_row12_one_query_fails_the_other_is_unaffected(spark, kafka, tmp_path):
    wa, wb = Workload(kafka, "r12a", partitions=1), Workload(kafka, "r12b", partitions=1)
    wa.produce(100)
    wb.produce(100)

    def failing(df, batch_id):
        if df.count():
            raise RuntimeError("query A fails")

    ca = BatchCollector()
    qa = (read_stream(spark, kafka, kafka.group(gid()), wa.topic).writeStream.foreachBatch(failing)
          .option("checkpointLocation", str(tmp_path / "cka")).start())
    qb = (read_stream(spark, kafka, kafka.group(gid()), wb.topic).writeStream.foreachBatch(ca)
          .option("checkpointLocation", str(tmp_path / "ckb")).start())
    try:
        with pytest.raises(Exception, match="query A fails"):
            qa.awaitTermination(120)
        wb.produce(100)
        wait_until(lambda: ca.has_all(wb.ids), timeout=60, message="query B stalled after A failed")
        assert qb.isActive
        wait_until(lambda: spark_share.status(qb)["inflightRecords"] == 0, timeout=30, message="B's acks missing")
    finally:
        qb.stop()
    # The embedded broker ends every share session when A's consumers disconnect, so records B held
    # at that moment come back once (a broker quirk, not B's failure); real Kafka does not.
    report = check_no_loss(wb.ids, ca.ids, duplicates_reason="B's in-flight records when A's consumers disconnected")
    assert report.duplicates <= (0 if kafka.external else 100), report


def test_verdicts_reject_release_and_accept(spark, kafka, tmp_path):
    w = Workload(kafka, "orders", partitions=2)
    w.produce(300)
    dlq = str(tmp_path / "dlq")
    collector = BatchCollector()

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        spark_share.reject(df.where("id % 10 = 0"), reason="id ends in 0")
        spark_share.release(df.where("id % 10 = 1 AND deliveryCount = 1"))

    group = kafka.group(gid())
    q = (read_stream(spark, kafka, group, w.topic, deadLetterPath=dlq).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    seen = [(r["id"], r["deliveryCount"]) for r in collector.rows]
    rejected = {i for i in w.ids if i % 10 == 0}
    released = {i for i in w.ids if i % 10 == 1}
    # REJECTed rows never come back; RELEASEd rows come back once, with deliveryCount 2.
    assert sorted(dc for i, dc in seen if i in rejected) == [1] * len(rejected)
    assert sorted(dc for i, dc in seen if i in released) == sorted([1, 2] * len(released))
    assert all(dc == 1 for i, dc in seen if i not in released)
    report = check_no_loss(w.ids, [i for i, _ in seen], duplicates_reason="each released row is seen twice")
    assert report.duplicates == len(released)
    # The broker was told REJECT, RELEASE and ACCEPT, and confirmed each.
    latest = q.recentProgress[-1]["sources"][0]["latestOffset"]
    latest = json.loads(latest) if isinstance(latest, str) else latest
    assert (latest["rejected"], latest["released"], latest["accepted"], latest["failed"]) == \
        (len(rejected), len(released), len(w.ids) - len(rejected), 0), latest
    # Every rejected record is in the dead-letter table, with its reason.
    dead = spark.read.parquet(dlq)
    expected = spark.createDataFrame([(i, "id ends in 0", 1) for i in sorted(rejected)],
                                     "id long, reason string, deliveryCount int")
    got = (dead.select(F.get_json_object(F.col("value").cast("string"), "$.id").cast("long").alias("id"),
                       "reason", "deliveryCount").orderBy("id"))
    assert_df_equality(got, expected, ignore_nullable=True)
    assert set(dead.columns) >= {"key", "value", "headers", "topic", "partition", "offset", "deliveryCount", "reason",
                                 "queryId", "batchId"}
    # Nothing is left for the group: accepted and rejected records are done.
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []


@pytest.mark.embedded_only("injects Produce errors on the dead-letter topic")
def test_verdicts_dead_letter_topic_that_refuses_writes_fails_the_query_and_loses_nothing(spark, kafka, tmp_path):
    """Writes to the dead-letter topic fail (TOPIC_AUTHORIZATION_FAILED on Produce): no REJECT is
    sent, the query fails naming deadLetterTopic, and the records come back after a restart."""
    w = Workload(kafka, "src", partitions=1)
    dead = kafka.create_topic("dead", 1)
    w.produce(20)
    refused = []

    first_agents = set()

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        if not refused:
            qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
            first_agents.update(p.pid for p in batch_agents(df))
            first_agents.add(registry(qid)["pid"])  # the tracker's process, with its metadata client
            kafka.push_request_errors("Produce", [29] * 50)  # TOPIC_AUTHORIZATION_FAILED, not retriable
            refused.append(True)
        spark_share.reject(df.where("id % 2 = 0"), reason="even")

    collector = BatchCollector()
    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    q = (read_stream(spark, kafka, group, w.topic, deadLetterTopic=dead).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="deadLetterTopic"):
        q.awaitTermination(120)
    kafka.clear_request_errors("Produce")
    # The embedded broker ends every share session when a client disconnects: let the failed run's
    # agent and tracker finish closing before the restart, so their goodbye does not reset the new
    # run's sessions.
    wait_until(lambda: not any(psutil.pid_exists(p) for p in first_agents), timeout=60,
               message="the failed run's processes did not exit")
    q = (read_stream(spark, kafka, group, w.topic, deadLetterTopic=dead).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="the first run's batch, released after its "
                                                                  "dead letters could not be written")
    assert report.duplicates == len(w.ids)
    assert {r["deliveryCount"] for b, rows in collector.batches.items() if b > 0 for r in rows} == {2}
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []


def test_verdicts_follow_spark_batch_ids_that_run_ahead_of_the_source(spark, kafka, tmp_path):
    """Another source in the query makes Spark run a batch in which kafka-share has nothing: Spark's
    batch ids then run ahead of the source's. Verdicts and commit signals name Spark's batch; they
    must land on the source batch Spark ran under that id, and on no other."""
    w = Workload(kafka, "mixed", partitions=1)
    files = tmp_path / "files"
    files.mkdir()
    seen = {}

    def process(df, batch_id):
        rows = df.collect()
        seen[batch_id] = rows
        kafka_rows = df.where("topic IS NOT NULL").withColumn("id", F.get_json_object("value", "$.id").cast("long"))
        spark_share.reject(kafka_rows.where("id % 2 = 0"), reason="even")

    ours = read_stream(spark, kafka, kafka.group(gid()), w.topic, idleProbeIntervalMs=600_000).select(
        F.col("value").cast("string").alias("value"), "topic", "partition", "offset")
    text = spark.readStream.format("text").load(str(files)).select(
        "value", F.lit(None).cast("string").alias("topic"), F.lit(None).cast("int").alias("partition"),
        F.lit(None).cast("long").alias("offset"))
    q = ours.unionByName(text).writeStream.foreachBatch(process).option("checkpointLocation",
                                                                          str(tmp_path / "ck")).start()
    try:
        wait_until(lambda: 0 in seen, timeout=60, message="first batch never ran")
        for name in ("a", "b"):  # the second file at the latest comes while kafka-share has nothing new
            (files / f"{name}.txt").write_text(f"from {name}\n")
            wait_until(lambda: any(r["value"] == f"from {name}" for rows in seen.values() for r in rows),
                       timeout=60, message="the file batch never ran")
        w.produce(20)
        wait_until(lambda: spark_share.status(q)["accepted"] + spark_share.status(q)["rejected"] == 20, timeout=60,
                   message="the Kafka records were not all acknowledged")
        status = spark_share.status(q)
    finally:
        q.stop()
    kafka_batches = [b for b, rows in seen.items() if any(r["topic"] for r in rows)]
    assert status["rejected"] == 10 and status["accepted"] == 10 and status["failed"] == 0
    assert any(b.get("sparkBatch", b["batch"]) != b["batch"] for b in status["batches"] if b["acquired"]), \
        f"Spark ids never ran ahead of the source's: {status['batches']}"
    report = check_no_loss(w.ids, [json.loads(r["value"])["id"] for b in kafka_batches for r in seen[b]])
    assert report.duplicates == 0


def test_row13_a_replayed_batch_reads_nothing_so_an_idempotent_writer_loses_nothing(spark, kafka, tmp_path):
    """foreachBatch counts the batch, skips a batch id it already wrote (Delta's txnAppId/txnVersion)
    and otherwise writes. Run 1 writes batch 0 and fails before Spark's commit: batch 0 is released,
    and another member of the group processes part of it. Spark replays batch 0 after the restart:
    new records under that id would be skipped by the writer and then ACCEPTed (lost)."""
    w = Workload(kafka, "replay", partitions=2)
    w.produce(400)
    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    written = {}  # batch id -> ids: the idempotent writer's table
    crashes = [RuntimeError("crash after the write, before Spark's commit")]

    def idempotent_write(df, batch_id):
        print(f"batch {batch_id}: {df.count()} rows")
        if batch_id in written:
            return
        written[batch_id] = ids_of(df.collect())
        if crashes:
            raise crashes.pop()

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="crash after the write"):
        q.awaitTermination(120)
    assert len(written[0]) > 100
    other = drain_share_group(kafka, group, [w.topic], timeout=30, until=100, max_poll_records=100)
    taken = ids_of({"value": v} for _, _, _, _, v in other)
    assert 0 < len(taken) < len(written[0]), "the other member should take part of the released batch"
    w.produce(200)
    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    replay = q.recentProgress[0]
    assert (replay["batchId"], replay["numInputRows"]) == (0, 0), "the replayed batch 0 read records"
    sink = [i for ids in written.values() for i in ids]
    report = check_no_loss(w.ids, sink + taken, duplicates_reason="batch 0's rows, written before the crash, "
                           "came back once (to the other member or to a later batch)")
    assert report.duplicates <= len(written[0])


def test_row14_an_action_on_a_batch_after_it_committed_acquires_nothing(spark, kafka, tmp_path):
    """A batch DataFrame kept and read again 25 batches later (as a zombie task attempt would) fails
    clearly and acquires nothing; before, it polled new records under the old batch id and the next
    commit ACCEPTed them unseen."""
    w = Workload(kafka, "kept", partitions=1)
    w.produce(60)
    kept, late = {}, []
    collector = BatchCollector()

    def process(df, batch_id):
        collector(df, batch_id)
        if batch_id == 0:
            kept["df"] = df
        if batch_id == 25:
            try:
                late.append(kept["df"].count())
            except Exception as e:
                late.append(str(e))

    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, maxRecordsPerTrigger=2).writeStream
         .foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    assert len(late) == 1 and isinstance(late[0], str), f"the late action returned {late}"
    assert "already committed and its records acknowledged" in late[0] and "persist()" in late[0], late[0][:2000]
    assert source_progress(q)["acquired"] == 60, "the late action acquired records"
    assert check_no_loss(w.ids, collector.ids).duplicates == 0


def test_row15_the_file_sink_skips_a_replayed_batch_and_loses_nothing(spark, kafka, tmp_path):
    """A crash between the file sink's commit and Spark's commit log (commits/0 removed): Spark
    replays batch 0, the sink skips it without reading, and the records produced meanwhile are
    written by the next batch."""
    w = Workload(kafka, "files", partitions=2)
    w.produce(200)
    group, ck, out = kafka.group(gid()), str(tmp_path / "ck"), str(tmp_path / "out")

    def run(**trigger):
        q = (read_stream(spark, kafka, group, w.topic).writeStream.format("parquet").option("path", out)
             .option("checkpointLocation", ck).trigger(**trigger).start())
        assert q.awaitTermination(120)
        assert q.exception() is None
        return q

    run(once=True)
    assert sorted(f for f in os.listdir(os.path.join(ck, "commits")) if not f.endswith(".crc")) == ["0"]
    for f in ("0", ".0.crc"):  # the crash: Spark never wrote batch 0's commit (nor its checksum)
        os.unlink(os.path.join(ck, "commits", f))
    w.produce(100)
    q = run(availableNow=True)
    assert q.recentProgress[0]["batchId"] == 0 and q.recentProgress[0]["numInputRows"] == 0
    rows = ids_of(spark.read.parquet(out).collect())
    # Batch 0 was in the commit log when the Trigger.Once run ended: ACCEPTed, not released.
    assert check_no_loss(w.ids, rows).duplicates == 0


@pytest.mark.parametrize("phase", ["latest_offset", "planning", "acknowledging"])
def test_row16_sigterm_at_each_phase_accepts_the_committed_batch_and_releases_the_rest(kafka, phase):
    kafka.set_record_lock_duration(60_000)  # only a release, not an expiry, hands records out in time
    group, query_id = kafka.group(gid()), f"q-{uuid.uuid4().hex[:8]}"
    w = Workload(kafka, f"term-{phase}", partitions=2)
    topic = w.topic
    first = w.produce(100)
    proc = subprocess.Popen([sys.executable, HARNESS, group, topic, phase, query_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(kafka.client()) + "\n")  # on stdin, not argv: it may hold credentials
        proc.stdin.flush()
        lines = Lines(proc)
        _, rows, tracker_id = lines.wait_for("READ")
        assert int(rows) == 100
        second = w.produce(50)  # batch 1's polls acquire these when it is planned
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines.wait_for("PHASE")
        t0 = time.monotonic()
        sigterm_to_another_thread(proc.pid)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM at {phase}: the process ended {took:.1f} s later")
    assert took < 12, f"the stop took {took:.1f} s"
    assert registry(query_id) is None, "the query registry file was left behind"
    wait_until(lambda: not agent_processes(tracker_id), timeout=30, message="the agent outlived its tracker")
    assert not os.path.exists(agent_socket_path(tracker_id))
    got = drain_share_group(kafka, group, [topic], timeout=15, until=len(second))
    ids = ids_of({"value": v} for _, _, _, _, v in got)
    # Batch 0 was committed: ACCEPTed, never delivered again. Batch 1 was not: released at once.
    assert not set(ids) & set(first), f"{len(set(ids) & set(first))} records of the committed batch came back"
    assert sorted(ids) == sorted(second)


def test_row17_agent_lost_while_a_batch_with_rejects_commits(kafka, tmp_path):
    """The live agent writes the dead letters it holds and acknowledges (its REJECT and ACCEPTs); the
    lost agent's records count as failed and come back; the query does not fail naming a target
    that was fine."""
    t, topic = tracker(kafka, "rejects", deadLetterPath=str(tmp_path / "dlq"))
    live, lost = StubAgent("live"), StubAgent("lost")
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, topic, 0, 0, 9)
        acquired(t, lost, 0, 1, topic, 1, 0, 9)
        t.batches[0].verdicts.update({(topic, 0, 3): (REJECT, "bad"), (topic, 1, 4): (REJECT, "bad")})
        t.batch_committed(0)
        assert t.failure is None
        dead = [r for r in live.sent if r["op"] == "deadletter"]
        assert [d["records"] for d in dead] == [[[topic, 0, 3, "bad"]]]
        ack = next(r for r in live.sent if r["op"] == "ack")
        assert ack["default"] == ACCEPT and [topic, 0, 3, REJECT] in ack["verdicts"]
        o = t.batches[0].outcome
        assert (o.failed, o.errors) == (10, {AGENT_LOST: 10})
    finally:
        t.agents.clear()
        t.shutdown()


def test_row18_a_rejected_record_two_agents_held_is_dead_lettered_by_the_live_one(kafka, tmp_path):
    """Found by the 60-minute chaos run (11 records lost): an agent is killed mid-batch after its slot
    was read; the broker hands the records it held to another agent, which reads them for another
    slot of the same batch; the application rejects them. The tracker asked only the first holder
    (the lost agent) to write the dead letters, and the live one REJECTed them unwritten. Now every
    live holder writes them, and an agent REJECTs only what it wrote itself."""
    t, topic = tracker(kafka, "twice", deadLetterPath=str(tmp_path / "dlq"))
    lost, live = StubAgent("lost"), StubAgent("live")
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, lost, 0, 0, topic, 0, 0, 9)  # read first, then its agent was killed
        acquired(t, live, 0, 1, topic, 0, 0, 9)  # the same records, released by the broker, read again
        t.batches[0].verdicts.update({(topic, 0, 3): (REJECT, "bad")})
        t.batch_committed(0)
        assert t.failure is None
        dead = [r for r in live.sent if r["op"] == "deadletter"]
        assert [d["records"] for d in dead] == [[[topic, 0, 3, "bad"]]], "the live holder must write it"
        ack = next(r for r in live.sent if r["op"] == "ack")
        assert ack["default"] == ACCEPT and [topic, 0, 3, REJECT] in ack["verdicts"]
        assert t.batches[0].outcome.errors == {AGENT_LOST: 10}
    finally:
        t.agents.clear()
        t.shutdown()


# --- tracker: which reads may acquire, and what a lost agent means ------------------------------------
def test_reads_of_batches_this_run_cannot_serve_are_refused(kafka):
    t, topic = tracker(kafka, "refused")
    a1, a2 = StubAgent("a1"), StubAgent("a2")
    t.agents.update(a1=a1, a2=a2)
    try:
        assert t.batch_to_read(4) is None, "a batch an earlier run planned (a replay) must read nothing"
        with pytest.raises(BatchRefused, match="planned by an earlier run"):
            t._claim(a1, Claim(4, 0))
        with pytest.raises(BatchRefused, match="never planned"):
            t._claim(a1, Claim(9, 0))
        b = t.plan(5, None)
        assert t.batch_to_read(5) is b and t._claim(a1, Claim(5, 0))["owner"] == "a1"
        acquired(t, a1, 5, 0, topic, 0, 0, 9)
        t.batch_committed(5)
        assert b.state == "acked"
        with pytest.raises(BatchRefused, match="already committed"):
            t._claim(a2, Claim(5, 0))
        with pytest.raises(BatchRefused, match="already committed"):
            t._claim(a2, Claim(2, 0))  # older than anything kept: finished long ago
        assert t.total_acquired == 10
    finally:
        t.agents.clear()
        t.shutdown()
    with pytest.raises(BatchRefused, match="stopping"):
        t._claim(a1, Claim(6, 0))
    assert t.plan(6, None) is None


def test_a_slot_whose_agent_is_lost_reads_nothing_new(kafka):
    """Re-reading a slot whose records a lost agent acquired gets no rows (its rows may be in a sink
    already; the broker releases them and they come back later); a slot claimed by a lost agent that
    never acquired anything is polled again (no row of it reached Spark)."""
    t, topic = tracker(kafka, "lost")
    a1, a2, a3 = StubAgent("a1"), StubAgent("a2"), StubAgent("a3")
    t.agents.update(a1=a1, a2=a2, a3=a3)
    try:
        t.plan(0, None)
        assert t._claim(a1, Claim(0, 0))["owner"] == "a1"
        acquired(t, a1, 0, 0, topic, 0, 0, 4)
        assert t._claim(a3, Claim(0, 1))["owner"] == "a3"
        del t.agents["a1"], t.agents["a3"]
        assert t._claim(a2, Claim(0, 0))["owner"] is None
        assert t._claim(a2, Claim(0, 1))["owner"] == "a2"
        t.batch_committed(0)
        assert t.batches[0].outcome.failed == 5 and t.batches[0].outcome.errors == {AGENT_LOST: 5}
    finally:
        t.agents.clear()
        t.shutdown()


def test_a_dead_letter_write_that_finds_fewer_records_still_fails(kafka, tmp_path):
    t, topic = tracker(kafka, "fewer", deadLetterPath=str(tmp_path / "dlq"))
    live = StubAgent("live", written=0)
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, topic, 0, 0, 9)
        t.batches[0].verdicts[(topic, 0, 3)] = (REJECT, "bad")
        with pytest.raises(Exception, match="deadLetterPath"):
            t.batch_committed(0)
        assert next(r for r in live.sent if r["op"] == "ack")["default"] != ACCEPT
    finally:
        t.agents.clear()
        t.shutdown()
