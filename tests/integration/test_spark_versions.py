"""What differs between the supported Sparks (spark_share/spark_versions.py), end to end on the Spark of
this run: CI runs these on PySpark 4.0, 4.1, 4.2 and 4.3 (docs/testing.md).

Spark 4.0 and 4.1 run Trigger.AvailableNow of a Python source as one batch: a plain
``trigger(availableNow=True)`` there is refused before the run can end half read, and
``spark_share.drain()`` drains on every version. They also call ``latestOffset()`` without a start or a
read limit: the source keeps the start (a restart goes on after the checkpoint's last batch) and applies
``maxRecordsPerTrigger`` itself."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    drain_share_group,
    gid,
    read_stream,
    wait_until,
)
from spark_share import spark_versions

pytestmark = pytest.mark.slow

WRAPPER = "spark.sql.streaming.triggerAvailableNowWrapper.enabled"


def test_a_drain_with_max_records_per_trigger_reads_every_record_and_ends(spark, kafka, tmp_path):
    """The scheduled drain of every version: 2,000 records at most 500 per batch, every record once,
    acknowledged, and the query ends by itself (Trigger.AvailableNow on Spark >= 4.2; on 4.0/4.1 the
    default trigger until the tracker says the queue held at the start is drained)."""
    w = Workload(kafka, "drain", partitions=2)
    w.produce(2000)
    group, collector = kafka.group(gid()), BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, maxRecordsPerTrigger=500).writeStream
                          .foreachBatch(collector).option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(180), "the drain did not end by itself"
    assert q.exception() is None
    sizes = [len(rows) for _, rows in sorted(collector.batches.items()) if rows]
    print(f"Spark {spark_versions.VERSION_TEXT}: drained 2,000 records in batches of {sizes}")
    assert max(sizes) <= 500 and len(sizes) >= 4, sizes
    report = check_no_loss(w.ids, collector.ids)
    assert report.duplicates == 0, report
    assert {r["deliveryCount"] for r in collector.rows} == {1}
    # The ended run's counts, on every Spark (Spark < 4.2 reports none in the progress).
    final = spark_share.status(q)
    assert final["view"] == "final" and final["query"] == str(q.id), final
    assert (final["acquired"], final["accepted"], final["failed"], final["inflightRecords"]) == (2000, 2000, 0, 0), final
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []

    # A second drain of the same checkpoint goes on after its last batch (on Spark < 4.2 the source
    # learns it from the restart's first call) and reads what came since.
    more = w.produce(300)
    again = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, maxRecordsPerTrigger=500).writeStream
                          .foreachBatch(again).option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(180), "the second drain did not end by itself"
    assert q.exception() is None
    assert sorted(again.ids) == sorted(more)
    assert min(again.batches) > max(collector.batches), (sorted(collector.batches), sorted(again.batches))


@pytest.mark.parametrize("wrapper", [False, True], ids=["plain", "with-spark-wrapper"])
def test_trigger_available_now_drains_or_is_refused_by_spark_version(spark, kafka, tmp_path, wrapper):
    """``trigger(availableNow=True)``: on Spark >= 4.2 it drains and ends. On 4.0/4.1 Spark would run one
    batch of at most 100 records here and end with 500 queued, reporting success, with Spark's wrapper
    setting or without it: the query is refused instead, naming the Spark version and
    ``spark_share.drain``, and loses nothing (a drain then reads all 600)."""
    w = Workload(kafka, "an", partitions=2)
    w.produce(600)
    group, collector = kafka.group(gid()), BatchCollector()
    spark.conf.set(WRAPPER, str(wrapper).lower())
    try:
        q = (read_stream(spark, kafka, group, w.topic, maxRecordsPerTrigger=100).writeStream.foreachBatch(collector)
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    finally:
        spark.conf.unset(WRAPPER)
    if spark_versions.NATIVE_AVAILABLE_NOW:
        assert q.awaitTermination(180), "the AvailableNow run did not end"
        assert q.exception() is None
        check_no_loss(w.ids, collector.ids)
        assert len(collector.batches) >= 6
        return
    with pytest.raises(Exception) as refused:
        q.awaitTermination(180)
    error = str(refused.value)
    assert "Trigger.AvailableNow" in error and spark_versions.VERSION_TEXT in error, error[-2000:]
    assert "spark_share.drain(writer)" in error, error[-2000:]
    assert not collector.rows, "a refused run handed rows to foreachBatch"
    rest = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(rest)
                          .option("checkpointLocation", str(tmp_path / "ck2")))
    assert q.awaitTermination(180)
    assert q.exception() is None
    check_no_loss(w.ids, rest.ids)


def test_status_and_prompt_acknowledgement_without_source_progress(spark, kafka, tmp_path):
    """Under a long processingTime trigger the listener acknowledges a batch as soon as Spark commits it
    (found by the query id where the progress carries no counters: Spark < 4.2), and status() answers."""
    w = Workload(kafka, "prompt", partitions=2)
    w.produce(200)
    group, collector = kafka.group(gid()), BatchCollector()
    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="60 seconds").start())
    try:
        wait_until(lambda: collector.has_all(w.ids), timeout=120, message="the first batch did not read the records")
        wait_until(lambda: spark_share.status(q)["accepted"] == 200, timeout=20,
                   message="the batch was not acknowledged within 20 s of its commit under a 60 s trigger")
        status = spark_share.status(q)
        assert status["query"] == str(q.id) and status["inflightRecords"] == 0, status
        # The watermarks behind the backlog refresh at least every 10 s (watermarks.BACKLOG_REFRESH_S).
        status = wait_until(lambda: (st := spark_share.status(q))["backlogEstimate"] is not None and st,
                            timeout=30, message="no backlog estimate in status() within 30 s")
        assert set(status["backlog"]) == {f"{w.topic}-0", f"{w.topic}-1"}, status
        # `spark-share status`: the queries running on this host, from their trackers.
        cli = subprocess.run([sys.executable, "-m", "spark_share.cli", "status", "--json"], capture_output=True,
                             text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr[-2000:]
        listed = [json.loads(line) for line in cli.stdout.splitlines() if line.startswith("{")]
        assert [st["accepted"] for st in listed if st.get("query") == str(q.id)] == [200], cli.stdout[-2000:]
    finally:
        q.stop()
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []
