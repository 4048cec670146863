"""What a stream that runs for weeks must not accumulate (issue 16): idle probes add nothing to the
agent's cache or to the tracker's log; an agent's memory is bounded (``agentCacheBytes``): past it,
batches wait for their acknowledgement in its executor's local dir."""
from __future__ import annotations

from harness.support import (
    BatchCollector,
    Workload,
    agent_addresses,
    agent_files,
    check_no_loss,
    gid,
    id_col,
    read_stream,
    registry,
    run_available_now,
    tracker_log,
    uid,
    wait_until,
)
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
        (address,) = agent_addresses(reg["tracker_id"])
        conn = endpoints.connect(address, reg["secret"], name="test")
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


def ping_agents(query_id: str) -> list[dict]:
    reg = registry(query_id)
    out = []
    for address in agent_addresses(reg["tracker_id"]):
        conn = endpoints.connect(address, reg["secret"], name="test")
        try:
            out.append(protocol.call(conn, protocol.Ping(), timeout=10)[0])
        finally:
            conn.close()
    return out


def test_an_agent_past_its_memory_budget_keeps_batches_in_its_local_dir(spark, kafka, tmp_path):
    """agentCacheBytes=0: every slot an agent acquires waits for its acknowledgement in a mapped file of its
    executor's local dir, none in memory. Two actions on a batch (the second re-reads from the agent) see the
    same rows, every record arrives once, and no file is left there."""
    w = Workload(kafka, "spill", partitions=2)
    w.produce(600)
    seen: list[int] = []
    pings: list[dict] = []

    def each(df, batch_id):
        ids = [r[0] for r in df.select(id_col()).collect()]
        assert df.count() == len(ids), "a second action on the batch saw other rows"
        seen.extend(ids)
        if ids:
            pings.extend(ping_agents(df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")))

    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, each, str(tmp_path / "ck"),
                          numPartitions=2, maxRecordsPerTrigger=200, agentCacheBytes=0)
    assert q.exception() is None
    print(f"agents' pings during the batches: {pings}")
    assert pings and all(p["cached_in_memory"] == 0 for p in pings), pings
    assert pings[-1]["spilled"] >= 4, "each batch's slots went to the local dir"
    check_no_loss(w.ids, seen)
    assert len(seen) == len(set(seen)) == 600
    assert agent_files(spark, "agent-cached-*") == [], "a mapped batch's file is unlinked once mapped"
