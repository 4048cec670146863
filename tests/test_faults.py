"""The fault matrix: each row injects one fault and checks that nothing is lost.

Each test prints "no-loss: produced N / delivered N / duplicates N / lost 0" and says which fault
explains its duplicates. Rows 1, 2, 6 and 11 of the matrix (foreachBatch raising after a write,
stop mid-batch, task retry, re-execution) are in test_source.py."""
from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections import Counter

import psutil
import pytest

import spark_share
from spark_share.embedded import EmbeddedKafka
from spark_share.runtime import runtime_dir
from support import (
    BatchCollector,
    Workload,
    agent_processes,
    batch_agents,
    check_no_loss,
    ids_of,
    kill,
    python_workers,
    read_stream,
    registry,
    runner_processes,
    tracker_log,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _register(spark):
    spark_share.register(spark)


def gid():
    return f"g-{uuid.uuid4().hex[:8]}"


def run_available_now(spark, kafka, group, topics, foreach, ckpt, **options):
    q = (read_stream(spark, kafka, group, topics, **options).writeStream.foreachBatch(foreach)
         .option("checkpointLocation", ckpt).trigger(availableNow=True).start())
    assert q.awaitTermination(180), "AvailableNow run did not end"
    return q


def source_progress(q) -> dict:
    latest = q.recentProgress[-1]["sources"][0]["latestOffset"]
    return json.loads(latest) if isinstance(latest, str) else latest


def test_row3_driver_side_killed_holding_records(spark, kafka, tmp_path):
    """The reader's runner process (the tracker) is SIGKILLed while a batch holds records: the
    agents see their tracker vanish, release everything and exit; a restart recovers all."""
    w = Workload(kafka, "r3", partitions=2)
    w.produce(200)
    group, ck = gid(), str(tmp_path / "ck")
    state = {}

    def kill_runner(df, batch_id):
        df.count()
        state["agents"] = {p.pid for p in batch_agents(df)}
        qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        runner = registry(qid)["pid"]  # the tracker's process: this query's runner
        assert runner in {p.pid for p in runner_processes()}
        state["killed"] = kill([psutil.Process(runner)])

    q = (read_stream(spark, kafka, group, "r3").writeStream.foreachBatch(kill_runner)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception):
        q.awaitTermination(120)
    assert state["killed"] >= 1 and state["agents"]
    wait_until(lambda: not (state["agents"] & {p.pid for p in agent_processes()}), timeout=30,
               message="agents outlived their tracker")
    collector = BatchCollector()
    q = run_available_now(spark, kafka, group, "r3", collector, ck)
    assert q.exception() is None
    check_no_loss(w.ids, collector.ids)


def test_row4_python_worker_killed_while_read_waits(spark, kafka, tmp_path):
    """A Python worker is SIGKILLed while its read() waits on the agent's poll: the task is retried
    in a new worker, which gets the same poll's result from the agent."""
    w = Workload(kafka, "r4", partitions=1)
    collector = BatchCollector()
    q = (read_stream(spark, kafka, gid(), "r4", pollTimeoutMs=8000).writeStream.foreachBatch(collector)
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
    back to the group (released when its connections drop, or when their 5 s locks expire) and are
    delivered again to a new agent."""
    kafka.set_record_lock_duration(5000)
    kafka.set_session_timeout(6000)  # the dead agent's members leave the group (and its partitions) sooner
    w = Workload(kafka, "r5", partitions=2)
    w.produce(200)
    killed = []

    def kill_agent(df, batch_id, rows):
        if batch_id == 0:
            killed.append(kill(batch_agents(df)))

    collector = BatchCollector(after=kill_agent)
    q = (read_stream(spark, kafka, gid(), "r5", idleProbeIntervalMs=1000).writeStream.foreachBatch(collector)
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


@pytest.mark.parametrize("inject", ["retriable", "fatal", "leader_move"])
def test_row7_share_fetch_errors(spark, tmp_path, inject):
    with EmbeddedKafka(brokers=2) as kafka:
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
                kafka.move_leader("r7", 0, 2)
                moved.append(True)
                w.produce(100)

        collector = BatchCollector()
        q = run_available_now(spark, kafka, gid(), "r7", process, str(tmp_path / "ck"))
        assert q.exception() is None
        if inject == "leader_move":
            assert moved == [True]
        else:  # the injected errors were served: more ShareFetch requests came than errors were queued
            assert kafka.request_count("ShareFetch") > {"retriable": 3, "fatal": 1}[inject]
        check_no_loss(w.ids, collector.ids, duplicates_reason="share sessions reset by the injected fault")


def test_row8_share_acknowledge_errors(spark, kafka, tmp_path):
    """The acknowledgement of batch 0 fails: the records come back, the failure is counted and
    logged with its error code, nothing is lost."""
    w = Workload(kafka, "r8", partitions=1)
    w.produce(100)

    def fail_the_ack(df, batch_id, rows):
        if batch_id == 0:
            kafka.push_request_errors("ShareAcknowledge", [29])

    collector = BatchCollector(after=fail_the_ack)
    q = run_available_now(spark, kafka, gid(), "r8", collector, str(tmp_path / "ck"))
    assert q.exception() is None
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="batch 0 came back after its ack failed")
    assert report.duplicates == 100
    assert {r["deliveryCount"] for b, rows in collector.batches.items() if b > 0 for r in rows} == {2}
    p = source_progress(q)
    assert p["failed"] == 100 and p["accepted"] == 100
    assert "'TOPIC_AUTHORIZATION_FAILED(29)': 100" in tracker_log(q)


def test_row9_broker_down_while_records_are_acquired(spark, kafka, tmp_path):
    w = Workload(kafka, "r9", partitions=2)
    w.produce(200)
    timers = []

    def outage(df, batch_id, rows):
        if batch_id == 0:
            kafka.broker_down(1)
            t = threading.Timer(3.0, kafka.broker_up, args=(1,))  # the outage lasts 3 s
            t.start()
            timers.append(t)

    collector = BatchCollector(after=outage)
    q = run_available_now(spark, kafka, gid(), "r9", collector, str(tmp_path / "ck"), ackTimeoutMs=10000)
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
    q = run_available_now(spark, kafka, gid(), "r10", slow, str(tmp_path / "ck"))
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
    q = run_available_now(spark, kafka, gid(), "r11", twice, str(tmp_path / "ck"))
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
    qa = (read_stream(spark, kafka, gid(), "r12a").writeStream.foreachBatch(failing)
          .option("checkpointLocation", str(tmp_path / "cka")).start())
    qb = (read_stream(spark, kafka, gid(), "r12b").writeStream.foreachBatch(ca)
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
    # at that moment come back once (a broker quirk, not B's failure); nothing is lost.
    report = check_no_loss(wb.ids, ca.ids, duplicates_reason="B's in-flight records when A's consumers disconnected")
    assert report.duplicates <= 100


def test_secrets_never_leak(spark, kafka, tmp_path):
    secret, key_secret = "S3cr3t-Pa55-" + uuid.uuid4().hex[:6], "KeyPa55-" + uuid.uuid4().hex[:6]
    w = Workload(kafka, "sec", partitions=1)
    w.produce(20)
    opts = {"kafka.sasl.username": "alice", "kafka.sasl.password": secret, "kafka.ssl.key.password": key_secret}
    texts = []

    def fail_second(df, batch_id):
        texts.append(repr(df.count()))
        if batch_id >= 1:
            raise RuntimeError("failing run")

    ck = str(tmp_path / "ck")
    q = run_available_now(spark, kafka, gid(), "sec", lambda df, b: df.count(), ck, **opts)
    texts.append(json.dumps([json.loads(p.json) for p in q.recentProgress]))
    w.produce(5)
    q = (read_stream(spark, kafka, gid(), "sec", **opts).writeStream.foreachBatch(fail_second)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception) as e:
        q.awaitTermination(120)
    texts.append(str(e.value))
    texts.append(json.dumps([json.loads(p.json) for p in q.recentProgress]))
    from spark_share.options import parse_options
    from spark_share.reader import SharePartition, ShareStreamReader
    reader = ShareStreamReader(parse_options({"kafka.bootstrap.servers": kafka.bootstrap_servers,
                                              "kafka.group.id": "g", "subscribe": "sec", **opts}))
    texts += [repr(reader.opts), str(reader.opts), repr(SharePartition("h", 1, "t", secret, 0, 0, None, 1))]
    for root in (ck, runtime_dir()):
        for dirpath, _, files in os.walk(root):
            for f in files:
                try:
                    texts.append(open(os.path.join(dirpath, f), errors="replace").read())
                except OSError:
                    pass
    blob = "\n".join(texts)
    assert "failing run" in blob  # the failing run's text is part of what was searched
    assert secret not in blob and key_secret not in blob
