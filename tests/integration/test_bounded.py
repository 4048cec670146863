"""What a stream that runs for weeks must not accumulate (issue 16): idle probes add nothing to the
agent's cache or to the tracker's log."""
from __future__ import annotations

from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    gid,
    read_stream,
    registry,
    tracker_log,
    uid,
    wait_until,
)
from spark_share.runtime import agent_socket_path
from spark_share.transport import endpoints, protocol


def test_idle_probes_leave_nothing_behind_in_the_agent_or_the_log(spark, kafka, tmp_path):
    w = Workload(kafka, "idle", partitions=2)
    w.produce(50)
    collector = BatchCollector()
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, numPartitions=2, idleProbeIntervalMs=100)
         .writeStream.foreachBatch(collector).queryName(uid("idle"))
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        wait_until(lambda: collector.has_all(w.ids), timeout=90, message="the records never reached the sink")
        first = wait_until(lambda: q.lastProgress, timeout=30, message="no progress reported")["batchId"]
        # Twenty more batches, each an idle probe whose polls come back empty.
        wait_until(lambda: q.lastProgress["batchId"] >= first + 20, timeout=120, message="no idle probes ran")
        reg = registry(str(q.id))
        conn = endpoints.connect(agent_socket_path(reg["tracker_id"]), reg["secret"], name="test")
        try:
            ping, _ = protocol.call(conn, protocol.Ping(), timeout=10)
        finally:
            conn.close()
        log = tracker_log(q)
    finally:
        q.stop()
    print(f"after {q.lastProgress['batchId']} batches: {ping['cached']} cached reads in the agent")
    # At most the reads of the batch in flight and the next one (2 slots each); before, every empty
    # read stayed cached for good (about 140,000 entries a day at 16 slots and a 10 s probe).
    assert ping["cached"] <= 4, ping
    batch_lines = [line for line in log.splitlines() if "spark-share batch " in line and "(group " in line]
    assert batch_lines and all("acquired 0," not in line for line in batch_lines), batch_lines[-3:]
    assert len(batch_lines) <= 3, f"{len(batch_lines)} INFO lines for batches that brought 50 records"
    check_no_loss(w.ids, collector.ids)
