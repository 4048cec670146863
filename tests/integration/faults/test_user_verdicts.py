"""Fault matrix, verdict rows: the application REJECTs and RELEASEs records.

REJECTed records are written to the dead-letter table and never come back, RELEASEd ones come back
once, the rest are ACCEPTed, and the broker confirmed each kind. When another source makes Spark's
batch ids run ahead of the source's, verdicts and commit signals still land on the right batch."""
from __future__ import annotations

import json

import pytest
from chispa import assert_df_equality
from pyspark.sql import functions as F

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    drain_share_group,
    gid,
    id_col,
    read_stream,
    source_progress,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
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
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, deadLetterPath=dlq).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
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
    latest = source_progress(q)
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


@pytest.mark.both_read_modes
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
