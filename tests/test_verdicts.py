"""Per-row verdicts from foreachBatch: reject, release, dead letters, poison records."""
from __future__ import annotations

import json
import shutil
import time
import uuid

import psutil
import pytest
from chispa import assert_df_equality
from confluent_kafka import Consumer
from pyspark.sql import Row
from pyspark.sql import functions as F

import spark_share
from spark_share.errors import VerdictError
from support import (
    BatchCollector,
    Workload,
    batch_agents,
    check_no_loss,
    drain_share_group,
    read_stream,
    registry,
    wait_until,
)


@pytest.fixture(autouse=True)
def _register(spark):
    spark_share.register(spark)


def gid():
    return f"g-{uuid.uuid4().hex[:8]}"


def id_col():
    return F.get_json_object(F.col("value").cast("string"), "$.id").cast("long")


def test_reject_release_and_accept(spark, kafka, tmp_path):
    w = Workload(kafka, "orders", partitions=2)
    w.produce(300)
    dlq = str(tmp_path / "dlq")
    collector = BatchCollector()

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        spark_share.reject(df.where("id % 10 = 0"), reason="id ends in 0")
        spark_share.release(df.where("id % 10 = 1 AND deliveryCount = 1"))

    group = gid()
    q = (read_stream(spark, kafka, group, "orders", deadLetterPath=dlq).writeStream.foreachBatch(process)
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
    assert drain_share_group(kafka.bootstrap_servers, group, ["orders"], timeout=3) == []


def test_dead_letter_topic_gets_original_record_and_reason_headers(spark, kafka, tmp_path):
    from confluent_kafka import Producer

    kafka.create_topic("in", 1)
    kafka.create_topic("dead", 1)
    p = Producer({"bootstrap.servers": kafka.bootstrap_servers, "log_level": 2})
    for i in range(20):
        p.produce("in", key=f"k{i}".encode(), value=b"{bad" if i % 5 == 0 else json.dumps({"id": i}).encode(),
                  headers=[("trace", f"t{i}".encode())])
    p.flush(10)

    def process(df, batch_id):
        parsed = df.withColumn("o", F.from_json(F.col("value").cast("string"), "id long"))
        spark_share.reject(parsed.where("o.id IS NULL"), reason="unparseable JSON")

    q = (read_stream(spark, kafka, gid(), "in", deadLetterTopic="dead").writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    c = Consumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": "reader",
                  "auto.offset.reset": "earliest"})
    c.subscribe(["dead"])
    got = []
    deadline = time.monotonic() + 20
    try:
        while len(got) < 4 and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is not None and m.error() is None:
                got.append(m)
    finally:
        c.close()
    assert len(got) == 4
    for m in got:
        h = {k: v for k, v in m.headers()}
        assert m.value() == b"{bad" and h["trace"] == b"t" + m.key()[1:]
        assert h["spark-share.reason"] == b"unparseable JSON" and h["spark-share.topic"] == b"in"
        assert int(h["spark-share.offset"]) % 5 == 0 and h["spark-share.deliveryCount"] == b"1"
        assert h["spark-share.queryId"] == str(q.id).encode() and h["spark-share.batchId"] == b"0"


def test_failed_dead_letter_write_acknowledges_nothing(spark, kafka, tmp_path):
    """The dead-letter target breaks before batch 0's rejects are written: nothing of batch 0 is
    acknowledged, the query fails naming the option, and a restart after the target is fixed gets
    every record back (deliveryCount 2) and writes the rejects."""
    w = Workload(kafka, "pay", partitions=1)
    w.produce(50)
    dlq = tmp_path / "dlq"
    collector = BatchCollector()

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        if batch_id == 0:  # the target breaks before this batch's rejects are written
            shutil.rmtree(dlq)
            dlq.write_text("not a directory")
        spark_share.reject(df.where("id % 7 = 0"), reason="seven")

    group, ck = gid(), str(tmp_path / "ck")
    q = (read_stream(spark, kafka, group, "pay", deadLetterPath=str(dlq)).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="deadLetterPath") as failure:
        q.awaitTermination(120)
    assert "released" in str(failure.value)
    assert {r["id"] for r in collector.batches[0]} == set(w.ids)
    dlq.unlink()  # the target is fixed; the restarted query gets batch 0's records back
    q = (read_stream(spark, kafka, group, "pay", deadLetterPath=str(dlq)).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    again = {r["id"] for b, rows in collector.batches.items() if b > 0 for r in rows if r["deliveryCount"] == 2}
    assert again == set(w.ids), "the batch whose dead letters failed was not delivered again in full"
    rejected = sorted(r["id"] for r in spark.read.parquet(str(dlq)).withColumn("id", id_col()).collect())
    assert rejected == [i for i in w.ids if i % 7 == 0]
    assert drain_share_group(kafka.bootstrap_servers, group, ["pay"], timeout=3) == []


def test_dead_letter_topic_that_refuses_writes_fails_the_query_and_loses_nothing(spark, kafka, tmp_path):
    """Writes to the dead-letter topic fail (TOPIC_AUTHORIZATION_FAILED on Produce): no REJECT is
    sent, the query fails naming deadLetterTopic, and the records come back after a restart."""
    w = Workload(kafka, "src", partitions=1)
    kafka.create_topic("dead", 1)
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
    group, ck = gid(), str(tmp_path / "ck")
    q = (read_stream(spark, kafka, group, "src", deadLetterTopic="dead").writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="deadLetterTopic"):
        q.awaitTermination(120)
    kafka.clear_request_errors("Produce")
    # The embedded broker ends every share session when a client disconnects: let the failed run's
    # agent and tracker finish closing before the restart, so their goodbye does not reset the new
    # run's sessions.
    wait_until(lambda: not any(psutil.pid_exists(p) for p in first_agents), timeout=60,
               message="the failed run's processes did not exit")
    q = (read_stream(spark, kafka, group, "src", deadLetterTopic="dead").writeStream.foreachBatch(process)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="the first run's batch, released after its "
                                                                  "dead letters could not be written")
    assert report.duplicates == len(w.ids)
    assert {r["deliveryCount"] for b, rows in collector.batches.items() if b > 0 for r in rows} == {2}
    assert drain_share_group(kafka.bootstrap_servers, group, ["src"], timeout=3) == []


def test_max_delivery_count_sets_a_poison_record_aside(spark, kafka, tmp_path):
    w = Workload(kafka, "jobs", partitions=1)
    w.produce(30)
    poison = 13
    dlq = str(tmp_path / "dlq")
    collector = BatchCollector()

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        # Processing of record 13 keeps failing: give it back each time; everything else succeeds.
        spark_share.release(df.where(f"id = {poison}"))

    q = (read_stream(spark, kafka, gid(), "jobs", deadLetterPath=dlq, maxDeliveryCount=3).writeStream
         .foreachBatch(process).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    seen = [(r["id"], r["deliveryCount"]) for r in collector.rows]
    assert sorted(dc for i, dc in seen if i == poison) == [1, 2], "the poison record reached user code at count 3"
    assert sorted(i for i, _ in seen if i != poison) == [i for i in w.ids if i != poison]
    dead = spark.read.parquet(dlq).collect()
    assert [json.loads(bytes(r["value"]))["id"] for r in dead] == [poison]
    assert dead[0]["deliveryCount"] == 3 and "maxDeliveryCount 3" in dead[0]["reason"]


def test_long_processing_time_trigger_acknowledges_within_a_second(spark, kafka, tmp_path):
    kafka.set_record_lock_duration(10_000)
    w = Workload(kafka, "slow", partitions=2)
    w.produce(100)
    done = {}

    def process(df, batch_id):
        df.count()
        done[batch_id] = time.monotonic()

    q = (read_stream(spark, kafka, gid(), "slow").writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="60 seconds").start())
    try:
        wait_until(lambda: 0 in done, timeout=60, message="first batch never ran")
        wait_until(lambda: spark_share.status(q)["accepted"] == 100, timeout=2,
                   message="acknowledgements waited for the next trigger")
        assert time.monotonic() - done[0] < 2
        assert spark_share.status(q)["expired"] == 0
    finally:
        q.stop()


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

    ours = read_stream(spark, kafka, gid(), "mixed", idleProbeIntervalMs=600_000).select(
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


def test_bad_verdicts_are_clear_errors(spark, kafka, tmp_path):
    w = Workload(kafka, "bad", partitions=1)
    w.produce(10)
    with pytest.raises(VerdictError, match="inside foreachBatch"):
        spark_share.reject(spark.createDataFrame([Row(topic="bad", partition=0, offset=1)]))
    errors = {}

    def process(df, batch_id):
        if df.count() == 0:
            return
        for name, call in {
            "columns": lambda: spark_share.reject(df.select("value")),
            "foreign": lambda: spark_share.reject([Row(topic="bad", partition=0, offset=999), Row(topic="bad", partition=0, offset=0)]),
            "both": lambda: (spark_share.reject(df.where("offset = 1")), spark_share.release(df.where("offset = 1"))),
        }.items():
            try:
                call()
                errors[name] = None
            except VerdictError as e:
                errors[name] = str(e)

    group = gid()
    q = (read_stream(spark, kafka, group, "bad").writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert "topic" in errors["columns"] and "offset" in errors["columns"]
    assert "1 of 2 rows are not from batch 0" in errors["foreign"] and "bad-0@999" in errors["foreign"]
    assert "cannot be both rejected and released" in errors["both"]
    # The refused verdicts changed nothing: offset 1 was rejected once, the rest accepted; none come back.
    assert drain_share_group(kafka.bootstrap_servers, group, ["bad"], timeout=3) == []


@pytest.mark.parametrize("option,value,needle", [("deadLetterTopic", "no-such-topic", "deadLetterTopic"),
                                                 ("deadLetterPath", None, "deadLetterPath")])
def test_bad_dead_letter_targets_fail_fast(spark, kafka, tmp_path, option, value, needle):
    kafka.create_topic("src", 1)
    if value is None:
        f = tmp_path / "a-file"
        f.write_text("x")
        value = str(f / "sub")
    q = (read_stream(spark, kafka, gid(), "src", **{option: value}).writeStream.format("noop")
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    with pytest.raises(Exception, match=needle):
        q.awaitTermination(60)
