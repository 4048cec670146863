"""Fault matrix: foreachBatch raises before Spark's commit (rows 1 and 12).

Row 1: the sink wrote, then the batch failed: nothing was ACCEPTed (invariant 1), a restart from the
checkpoint gets every record of the batch again, as its 2nd delivery (on the embedded broker each delivery
may come one later: a consumer's join ends the others' share sessions there). Row 12: one query fails, the
other query on the same broker goes on unaffected."""
from __future__ import annotations

import json
import os

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    agent_processes,
    batch_agents,
    check_no_loss,
    gid,
    read_stream,
    uid,
    wait_until,
)
from spark_share.consumers.agent import CLOSE_WAIT_S

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row1_crash_after_sink_write_redelivers_the_batch(spark, kafka, tmp_path, read_mode):
    """Invariant 1: nothing is ACCEPTed before the batch is in the commit log. With readMode=driver, Spark's
    run of batch 0 again carries exactly its records (a sink idempotent per batch id writes none twice)."""
    w = Workload(kafka, "payments", partitions=2)
    w.produce(300)
    group, ck = kafka.group(uid("g")), str(tmp_path / "ck")
    out = str(tmp_path / "out")
    agents: set[int] = set()

    def write_then_crash(df, batch_id):
        df.write.mode("append").parquet(out)
        agents.update(p.pid for p in batch_agents(df))
        raise RuntimeError("crash after the sink wrote, before the commit")

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(write_then_crash)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="crash after the sink wrote"):
        q.awaitTermination(120)
    first = spark.read.parquet(out).collect()
    # Real Kafka: each record of the failed batch is delivered for the 1st time, and comes back as its 2nd
    # delivery. The embedded broker ends every member's share session when another joins: a consumer joining
    # while another one's fetch is under way sends the records that fetch acquired back once more, unseen
    # (twice in CI, both at the restart on PySpark 4.0.5; a probe of two new consumers after two closed
    # ones: 2 of 12 trials, a whole partition at deliveryCount 3). There each delivery may come one later.
    late = 0 if kafka.external else 1
    assert len(first) > 0 and {r["deliveryCount"] for r in first} <= {1, 1 + late}
    assert not os.path.exists(os.path.join(ck, "commits", "0"))
    # The embedded broker ends every share session when a client disconnects: had the failed run's
    # agent closed its consumers while the restart held batch 0, the batch would come back a third
    # time. Its agent ends within a bounded time after its tracker; real Kafka needs no wait.
    wait_until(lambda: not agents & {p.pid for p in agent_processes()}, timeout=CLOSE_WAIT_S + 15,
               message="the failed run's agent outlived its tracker")

    # Restart from the checkpoint: batch 0 is replayed and every record of it comes back.
    collector = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(collector)
         .option("checkpointLocation", ck))
    assert q.awaitTermination(120)
    assert q.exception() is None
    redelivered = {json.loads(bytes(r["value"]))["id"]: r["deliveryCount"] for r in collector.rows}
    for r in first:
        i, allowed = json.loads(bytes(r["value"]))["id"], range(r["deliveryCount"] + 1, r["deliveryCount"] + 2 + late)
        assert redelivered.get(i) in allowed, (
            f"record {i} of the failed batch (delivery {r['deliveryCount']}) came back as delivery "
            f"{redelivered.get(i)}, not {list(allowed)}")
    check_no_loss(w.ids, collector.ids)
    if read_mode == "driver":
        again = sorted(json.loads(bytes(r["value"]))["id"] for r in collector.batches.get(0, []))
        assert again == sorted(json.loads(bytes(r["value"]))["id"] for r in first), \
            "batch 0, run again, carried other records than the failed run wrote"


@pytest.mark.both_read_modes
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
