"""Fault matrix: the dead-letter target cannot be written.

Writes to the dead-letter topic are refused (Produce errors, embedded broker only): no REJECT is
sent, the query fails naming deadLetterTopic, the records come back after a restart. A dead-letter
write that finds fewer records than were rejected fails too, and the batch is not ACCEPTed."""
from __future__ import annotations

import psutil
import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    batch_agents,
    check_no_loss,
    drain_share_group,
    gid,
    id_col,
    read_stream,
    registry,
    wait_until,
)
from spark_share.acknowledgement import ACCEPT, REJECT
from spark_share.verdict_set import VerdictSet

from .helpers import StubAgent, acquired, tracker

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
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
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, deadLetterTopic=dead).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck))
    with pytest.raises(Exception, match="deadLetterTopic"):
        q.awaitTermination(120)
    kafka.clear_request_errors("Produce")
    seen_by_the_first_run = len(collector.rows)
    # The embedded broker ends every share session when a client disconnects: let the failed run's
    # agent and tracker finish closing before the restart, so their goodbye does not reset the new
    # run's sessions.
    wait_until(lambda: not any(psutil.pid_exists(p) for p in first_agents), timeout=60,
               message="the failed run's processes did not exit")
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic, deadLetterTopic=dead).writeStream.foreachBatch(process)
         .option("checkpointLocation", ck))
    assert q.awaitTermination(120)
    assert q.exception() is None
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="the first run's batch, released after its "
                                                                  "dead letters could not be written")
    assert report.duplicates == len(w.ids)
    # The restart's rows (readMode=driver: batch 0 run again with its own records; executors: later batches)
    # are every record's 2nd delivery.
    assert {r["deliveryCount"] for r in collector.rows[seen_by_the_first_run:]} == {2}
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []


def test_a_dead_letter_write_that_finds_fewer_records_still_fails(kafka, tmp_path):
    t, topic = tracker(kafka, "fewer", deadLetterPath=str(tmp_path / "dlq"))
    live = StubAgent("live", written=0)
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, topic, 0, 0, 9)
        t.batches[0].verdicts.update(VerdictSet.from_records([(topic, 0, 3, REJECT, "bad")]))
        with pytest.raises(Exception, match="deadLetterPath"):
            t.batch_committed(0)
        assert next(r for r in live.sent if r["op"] == "ack")["default"] != ACCEPT
    finally:
        t.agents.clear()
        t.shutdown()
