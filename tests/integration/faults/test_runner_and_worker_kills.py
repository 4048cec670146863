"""Fault matrix: a process of the read path is SIGKILLed (rows 3 and 4).

Row 3: the reader's runner process (the tracker) dies holding records: its agents release
everything and exit, a restart recovers all. Row 4: a Python worker dies while its read() waits on
the agent's poll: the retried task gets that poll's result, no duplicates."""
from __future__ import annotations

import psutil
import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    agent_processes,
    batch_agents,
    check_no_loss,
    gid,
    ids_of,
    kill,
    read_stream,
    registry,
    run_available_now,
    runner_processes,
    source_progress,
    wait_until,
    workers_talking_to,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row3_driver_side_killed_holding_records(spark, kafka, tmp_path, read_mode):
    """The reader's runner process (the tracker) is SIGKILLed while a batch holds records: the
    agents see their tracker vanish, release everything and exit (readMode=driver: the consumers die
    with it); a restart recovers all (readMode=driver: Spark had committed the batch, so its records are
    ACCEPTed when they come back, not emitted again)."""
    w = Workload(kafka, "r3", partitions=2)
    w.produce(200)
    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    state = {}

    def kill_runner(df, batch_id):
        state["ids"] = ids_of(df.collect())
        state["agents"] = {p.pid for p in batch_agents(df)}
        qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        runner = registry(qid)["pid"]  # the tracker's process: this query's runner
        assert runner in {p.pid for p in runner_processes()}
        state["killed"] = kill([psutil.Process(runner)])

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(kill_runner)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception):
        q.awaitTermination(120)
    assert state["killed"] >= 1
    assert bool(state["agents"]) == (read_mode == "executors"), state["agents"]
    wait_until(lambda: not (state["agents"] & {p.pid for p in agent_processes()}), timeout=30,
               message="agents outlived their tracker")
    collector = BatchCollector()
    q = run_available_now(spark, kafka, group, w.topic, collector, ck)
    assert q.exception() is None
    if read_mode == "driver":
        # foreachBatch returned, so Spark committed batch 0 before the next trigger found the runner gone; its
        # offset names its records: they come back unacknowledged and are ACCEPTed, never emitted again.
        assert not set(collector.ids) & set(state["ids"]), "records of the committed batch 0 were emitted again"
        assert check_no_loss(w.ids, state["ids"] + collector.ids).duplicates == 0
        assert source_progress(q).get("acceptedAgain") == len(state["ids"])
    else:  # the agents released batch 0 unacknowledged: it comes back
        check_no_loss(w.ids, collector.ids)


def test_row4_python_worker_killed_while_read_waits(spark, kafka, tmp_path):
    """A Python worker is SIGKILLed while its read() waits on the agent's poll: the task is retried
    in a new worker, which gets the same poll's result from the agent."""
    w = Workload(kafka, "r4", partitions=1)
    collector = BatchCollector()
    if not kafka.external:
        # A poll ends as soon as the broker answers a fetch empty (within milliseconds here): the embedded
        # broker answers the first fetches 5 s late, so the read surely waits when its worker is killed.
        kafka.push_broker_request_errors(1, "ShareFetch", [(0, 5000)] * 2)
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, pollTimeoutMs=8000).writeStream.foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")).start())

    def polling():
        if not registry(q.id):
            return False
        return any(b.get("polling") for b in spark_share.status(q)["batches"])

    try:
        # A read task waits on the agent's poll (nothing to read yet, an 8 s poll): kill its worker.
        wait_until(polling, timeout=60, message="no read in progress")
        # Only the read's worker: an idle pooled one killed too could be handed the retry before Spark sees
        # it dead, and a second failed attempt ends the query (local[2,2]).
        agents = [p.pid for p in agent_processes(registry(q.id)["tracker_id"])]
        reading = workers_talking_to(agents)
        assert reading and polling(), "no read in flight to kill"
        assert kill(reading) >= 1
        w.produce(100)
        wait_until(lambda: len(collector.rows) >= 100, timeout=60, message="records not delivered")
    finally:
        q.stop()
    report = check_no_loss(w.ids, collector.ids)
    assert report.duplicates == 0
