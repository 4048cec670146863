"""Per-row verdicts from foreachBatch: reject, release, dead letters, poison records."""
from __future__ import annotations

import json
import shutil
import time

import pytest
from confluent_kafka import Consumer
from pyspark.sql import Row
from pyspark.sql import functions as F

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    drain_share_group,
    gid,
    id_col,
    long_trigger,
    read_stream,
    wait_until,
)
from spark_share.errors import VerdictError


@pytest.mark.both_read_modes
def test_dead_letter_topic_gets_original_record_and_reason_headers(spark, kafka, tmp_path):
    from confluent_kafka import Producer

    source, dead = kafka.create_topic("in", 1), kafka.create_topic("dead", 1)
    p = Producer({**kafka.client(), "log_level": 2})
    for i in range(20):
        p.produce(source, key=f"k{i}".encode(), value=b"{bad" if i % 5 == 0 else json.dumps({"id": i}).encode(),
                  headers=[("trace", f"t{i}".encode())])
    p.flush(10)

    def process(df, batch_id):
        parsed = df.withColumn("o", F.from_json(F.col("value").cast("string"), "id long"))
        spark_share.reject(parsed.where("o.id IS NULL"), reason="unparseable JSON")

    q = spark_share.drain(read_stream(spark, kafka, kafka.group(gid()), source, deadLetterTopic=dead).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    c = Consumer({**kafka.client(), "group.id": kafka.name("reader"), "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})  # commits nothing: the group leaves no trace on a cluster
    c.subscribe([dead])
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
        assert h["spark-share.reason"] == b"unparseable JSON" and h["spark-share.topic"] == source.encode()
        assert int(h["spark-share.offset"]) % 5 == 0 and h["spark-share.deliveryCount"] == b"1"
        assert h["spark-share.queryId"] == str(q.id).encode() and h["spark-share.batchId"] == b"0"


@pytest.mark.both_read_modes
def test_failed_dead_letter_write_acknowledges_nothing(spark, kafka, tmp_path):
    """The dead-letter target breaks before batch 0's rejects are written: nothing of batch 0 is
    acknowledged, the query fails naming the option, and a restart after the target is fixed gets
    every record back (deliveryCount 2) and writes the rejects."""
    w = Workload(kafka, "pay", partitions=1)
    w.produce(50)
    dlq = tmp_path / "dlq"
    collector = BatchCollector()
    breaks = [True]

    def process(df, batch_id):
        df = df.withColumn("id", id_col())
        collector(df, batch_id)
        if breaks:  # the target breaks before the first batch's rejects are written
            breaks.pop()
            shutil.rmtree(dlq)
            dlq.write_text("not a directory")
        spark_share.reject(df.where("id % 7 = 0"), reason="seven")

    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, deadLetterPath=str(dlq)).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck))
    with pytest.raises(Exception, match="deadLetterPath") as failure:
        q.awaitTermination(120)
    assert "released" in str(failure.value)
    assert {r["id"] for r in collector.batches[0]} == set(w.ids)
    seen_by_the_first_run = len(collector.rows)
    dlq.unlink()  # the target is fixed; the restarted query gets batch 0's records back
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, deadLetterPath=str(dlq)).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck))
    assert q.awaitTermination(120)
    assert q.exception() is None
    # readMode=driver: batch 0 run again with its own records; executors: they come in later batches.
    again = {r["id"] for r in collector.rows[seen_by_the_first_run:] if r["deliveryCount"] == 2}
    assert again == set(w.ids), "the batch whose dead letters failed was not delivered again in full"
    rejected = sorted(r["id"] for r in spark.read.parquet(str(dlq)).withColumn("id", id_col()).collect())
    assert rejected == [i for i in w.ids if i % 7 == 0]
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []


@pytest.mark.both_read_modes
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

    q = spark_share.drain(read_stream(spark, kafka, kafka.group(gid()), w.topic, deadLetterPath=dlq, maxDeliveryCount=3).writeStream
         .foreachBatch(process).option("checkpointLocation", str(tmp_path / "ck"))
         )
    assert q.awaitTermination(120)
    assert q.exception() is None
    seen = [(r["id"], r["deliveryCount"]) for r in collector.rows]
    assert sorted(dc for i, dc in seen if i == poison) == [1, 2], "the poison record reached user code at count 3"
    assert sorted(i for i, _ in seen if i != poison) == [i for i in w.ids if i != poison]
    dead = spark.read.parquet(dlq).collect()
    assert [json.loads(bytes(r["value"]))["id"] for r in dead] == [poison]
    assert dead[0]["deliveryCount"] == 3 and "maxDeliveryCount 3" in dead[0]["reason"]


@pytest.mark.both_read_modes
def test_long_processing_time_trigger_acknowledges_within_a_second(spark, kafka, tmp_path):
    kafka.set_record_lock_duration(10_000)
    w = Workload(kafka, "slow", partitions=2)
    w.produce(100)
    done = {}

    def process(df, batch_id):
        df.count()
        done[batch_id] = time.monotonic()

    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime=long_trigger()).start())
    try:
        wait_until(lambda: 0 in done, timeout=60, message="first batch never ran")
        wait_until(lambda: spark_share.status(q)["accepted"] == 100, timeout=2,
                   message="acknowledgements waited for the next trigger")
        assert time.monotonic() - done[0] < 2
        assert spark_share.status(q)["expired"] == 0
    finally:
        q.stop()


@pytest.mark.both_read_modes
def test_bad_verdicts_are_clear_errors(spark, kafka, tmp_path):
    w = Workload(kafka, "bad", partitions=1)
    w.produce(10)
    topic = w.topic
    with pytest.raises(VerdictError, match="inside foreachBatch"):
        spark_share.reject(spark.createDataFrame([Row(topic=topic, partition=0, offset=1)]))
    errors = {}

    def process(df, batch_id):
        if df.count() == 0:
            return
        for name, call in {
            "columns": lambda: spark_share.reject(df.select("value")),
            "foreign": lambda: spark_share.reject([Row(topic=topic, partition=0, offset=999),
                                                   Row(topic=topic, partition=0, offset=0)]),
            "both": lambda: (spark_share.reject(df.where("offset = 1")), spark_share.release(df.where("offset = 1"))),
        }.items():
            try:
                call()
                errors[name] = None
            except VerdictError as e:
                errors[name] = str(e)

    group = kafka.group(gid())
    q = spark_share.drain(read_stream(spark, kafka, group, topic).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert "topic" in errors["columns"] and "offset" in errors["columns"]
    assert "1 of 2 rows are not from batch 0" in errors["foreign"] and f"{topic}-0@999" in errors["foreign"]
    assert "cannot be both rejected and released" in errors["both"]
    # The refused verdicts changed nothing: offset 1 was rejected once, the rest accepted; none come back.
    assert drain_share_group(kafka, group, [topic], timeout=3) == []


@pytest.mark.parametrize("option,value,needle", [("deadLetterTopic", "no-such-topic", "deadLetterTopic"),
                                                 ("deadLetterPath", None, "deadLetterPath")])
def test_bad_dead_letter_targets_fail_fast(spark, kafka, tmp_path, option, value, needle):
    topic = kafka.create_topic("src", 1)
    if value is None:
        f = tmp_path / "a-file"
        f.write_text("x")
        value = str(f / "sub")
    else:
        value = kafka.name(value)  # a topic that does not exist
    q = (read_stream(spark, kafka, kafka.group(gid()), topic, **{option: value}).writeStream.format("noop")
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    with pytest.raises(Exception, match=needle):
        q.awaitTermination(60)
