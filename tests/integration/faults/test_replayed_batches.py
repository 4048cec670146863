"""Invariant 9 at the source, without Spark: a driver lost with batch 0's records held and unacknowledged
(SIGKILL of ``replay_harness.py``, which drives the reader as Spark's runner does, readMode=driver).

A restart in which Spark runs batch 0 again (its commit log lacks it) must get batch 0's records, and
nothing else, under that id; a restart in which Spark committed batch 0 (its commit log has it, the
acknowledgement never happened) must never emit them again: they are ACCEPTed when they come back. A
toy (poll anew for the replay, or read nothing) fails both: new records under batch 0, or batch 0's
records in batch 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import spark_share
from harness.support import (
    Workload,
    check_no_loss,
    drain_share_group,
    gid,
    ids_of,
    kafka_options,
    read_stream,
    wait_until,
)
from spark_share.options import parse_options
from spark_share.reader import ShareStreamReader
from spark_share.spark_versions import ReadAllAvailable

from .test_stop_mid_batch import Lines

HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "replay_harness.py")
pytestmark = pytest.mark.slow


def lost_driver(kafka, group: str, topic: str) -> tuple[dict, list[int]]:
    """Batch 0 read by a run that is then SIGKILLed: (its end offset, the ids it read). The lost run's members
    keep their partitions until the group's session timeout (the embedded broker gives each partition to one
    member): 10 s here, which the restart's replay waits out. Not less: the embedded broker also ends a share
    session that fetched nothing for that long, and a batch may wait up to JOIN_GRACE_S (8 s) for a session of
    the restart that has no partition yet, its records held by another."""
    kafka.set_session_timeout(10_000)
    proc = subprocess.Popen([sys.executable, HARNESS, group, topic], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(kafka.client()) + "\n")  # on stdin, not argv: it may hold credentials
        proc.stdin.flush()
        lines = Lines(proc)
        end = json.loads(" ".join(lines.wait_for("OFFSET")[1:]))
        ids = json.loads(" ".join(lines.wait_for("IDS")[1:]))
    finally:
        proc.kill()
        proc.wait()
    return end, ids


def reader_for(kafka, group: str, topic: str, **options: str) -> ShareStreamReader:
    """The source as Spark has it (no maxRecordsPerTrigger unless given: ``drain`` asks for every record available)."""
    return ShareStreamReader(parse_options({**kafka_options(kafka), "kafka.group.id": group, "subscribe": topic,
                                            "numPartitions": "2", **options}))


def read(reader, start, end) -> list[int]:
    return ids_of({"value": v} for p in reader.partitions(start, end) for rb in reader.read(p)
                  for v in rb.column("value").to_pylist())


def stopped_run(kafka, group: str, topic: str, **options: str) -> tuple[dict, list[int]]:
    """Batch 0 read by a run that then stops with it uncommitted (released, and the run's end says its consumers
    closed): (its end offset, the ids it read)."""
    earlier = reader_for(kafka, group, topic, **options)
    try:
        start = earlier.initialOffset()
        end0 = earlier.latestOffset(start, earlier.getDefaultReadLimit())
        return end0, read(earlier, start, end0)
    finally:
        earlier.stop()


def drain(reader, start, want: set[int], timeout: float = 60) -> list[int]:
    """Batches after ``start``, as Spark's triggers ask for them, until every id of ``want`` was read (or
    ``timeout``): every id read, in order."""
    got: list[int] = []
    at = [start]

    def next_batch() -> bool:
        end = reader.latestOffset(at[0], ReadAllAvailable())
        if end != at[0]:
            got.extend(read(reader, at[0], end))
            at[0] = end
        return want <= set(got)

    wait_until(next_batch, timeout=timeout, message=f"the batches after {start} did not read every record")
    reader.commit(at[0])  # Spark's commit log has the last batch: acknowledged, as Spark's next trigger does
    return got


def test_a_batch_run_again_after_a_lost_driver_carries_the_same_records(kafka):
    w = Workload(kafka, "replayed", partitions=2)
    w.produce(300)
    group = kafka.group(gid())
    end0, first = lost_driver(kafka, group, w.topic)
    assert first, first
    w.produce(100)  # records of no batch yet: a replay's polls that bring them keep them for the next batch
    assert "records" in end0, "readMode=driver's offset must name the batch's records"

    reader = reader_for(kafka, group, w.topic)
    try:
        start = reader.initialOffset()
        # A restart: Spark first runs batch 0 again (offsets/0 is in its log, commits/0 is not). Spark < 4.2
        # first names the offset log's last batch, committed or not (PySpark 4.1.4 measured).
        assert reader.partitions(end0, end0) == []
        again = read(reader, start, end0)
        assert sorted(again) == sorted(first), "the replayed batch 0 carried other records than its first run"
        status = reader._tracker.status()
        replayed = [b for b in status["batches"] if b["batch"] == 0][0]
        assert replayed["replay"] == {"wanted": len(first), "missing": 0}, replayed
        rest = drain(reader, end0, set(w.ids) - set(first))
    finally:
        reader.stop()
    assert not set(rest) & set(first), "records of batch 0 came back in a later batch"
    assert check_no_loss(w.ids, again + rest).duplicates == 0


def test_a_batch_run_again_under_a_smaller_maxrecordspertrigger_still_carries_all_its_records(kafka):
    """A restart with a smaller maxRecordsPerTrigger: the replayed batch is the earlier run's, bigger than the
    new polls. Each session polls once per batch (the client polls again only after an acknowledgement), and
    the embedded broker gives a partition to one member, so polls of the new size would miss most of it."""
    w = Workload(kafka, "resized", partitions=2)
    w.produce(300)
    group = kafka.group(gid())
    end0, first = stopped_run(kafka, group, w.topic)
    assert sorted(first) == sorted(w.ids), "the first run's batch 0 should take every record"

    reader = reader_for(kafka, group, w.topic, maxRecordsPerTrigger="50")
    try:
        again = read(reader, reader.initialOffset(), end0)
        replayed = [b for b in reader._tracker.status()["batches"] if b["batch"] == 0][0]
        reader.commit(end0)
    finally:
        reader.stop()
    assert replayed["replay"] == {"wanted": len(first), "missing": 0}, replayed
    assert sorted(again) == sorted(first), f"the replayed batch 0 carried {len(again)} of its {len(first)} records"
    assert not drain_share_group(kafka, group, [w.topic], timeout=5), "records were left in the group"


def test_a_replay_reaches_every_partition_of_its_batch_past_later_records_of_another(kafka):
    """One consumer, a batch on two partitions, and later records on both before the replay. A fetch spends
    its record limit partition by partition (both brokers): a replay polling the batch's size fills up with
    the first partition's later records and never reaches the other's share of the batch (on Kafka 4.2 a
    replay of 300 on 2 partitions got one partition's 150 so)."""
    w = Workload(kafka, "greedy", partitions=2)
    w.produce(200)
    group = kafka.group(gid())
    one = {"numPartitions": "1", "maxRecordsPerTrigger": "300"}
    end0, first = stopped_run(kafka, group, w.topic, **one)
    # Both partitions' records on the embedded broker (its first fetch reaches both); a real Kafka's first
    # fetch may bring one partition only, as it initialises the group's other one.
    assert first and set(first) <= set(w.ids), first
    w.produce(800)  # 400 more on each partition, after the batch's records

    reader = reader_for(kafka, group, w.topic, **one)
    try:
        start = reader.initialOffset()
        again = read(reader, start, end0)
        replayed = [b for b in reader._tracker.status()["batches"] if b["batch"] == 0][0]
        rest = drain(reader, end0, set(w.ids) - set(first))
    finally:
        reader.stop()
    assert replayed["replay"] == {"wanted": len(first), "missing": 0}, replayed
    assert sorted(again) == sorted(first), f"the replayed batch 0 carried {len(again)} of its {len(first)} records"
    assert not set(rest) & set(first), "records of batch 0 came back in a later batch"
    assert check_no_loss(w.ids, again + rest).duplicates == 0
    assert not drain_share_group(kafka, group, [w.topic], timeout=5), "records were left in the group"


def test_no_member_joins_while_a_replay_reads(kafka, monkeypatch):
    """On a cluster the driver's agent starts with one consumer and opens more as a batch's slots need them.
    A replay must not: a member joining moves partitions under the consumers that already polled (Kafka, a
    heartbeat later), or ends their share sessions (the embedded broker), and those may not poll again."""
    w = Workload(kafka, "nojoin", partitions=2)
    w.produce(300)
    group = kafka.group(gid())
    end0, first = stopped_run(kafka, group, w.topic)
    assert first
    monkeypatch.setenv("SPARK_SHARE_MASTER", "spark://cluster:7077")  # a cluster's driver: one consumer to start

    reader = reader_for(kafka, group, w.topic)
    try:
        again = read(reader, reader.initialOffset(), end0)
        replayed = [b for b in reader._tracker.status()["batches"] if b["batch"] == 0][0]
        members = reader._tracker.progress()["members"]
        rest = drain(reader, end0, set(w.ids) - set(first))
    finally:
        reader.stop()
    assert members == 1, f"{members} members after the replay: one joined while it read"
    assert replayed["replay"] == {"wanted": len(first), "missing": 0}, replayed
    assert sorted(again) == sorted(first)
    assert check_no_loss(w.ids, again + rest).duplicates == 0


def test_records_of_a_committed_batch_are_accepted_when_they_come_back_never_emitted(kafka):
    w = Workload(kafka, "committed", partitions=2)
    w.produce(300)
    group = kafka.group(gid())
    end0, first = lost_driver(kafka, group, w.topic)
    assert first
    w.produce(100)

    reader = reader_for(kafka, group, w.topic)
    try:
        reader.initialOffset()
        # A restart after Spark's commit log had batch 0 and before its acknowledgement: Spark asks for what
        # follows batch 0 (Spark < 4.2 first names it through partitions(end, end)).
        assert reader.partitions(end0, end0) == []
        rest = drain(reader, end0, set(w.ids) - set(first))
        accepted_again = reader._tracker.progress().get("acceptedAgain", 0)
    finally:
        reader.stop()
    assert not set(rest) & set(first), f"{len(set(rest) & set(first))} records of the committed batch 0 were emitted"
    assert sorted(rest) == sorted(set(w.ids) - set(first))
    assert accepted_again == len(first), "every record of batch 0 should come back and be ACCEPTed unseen"
    assert not drain_share_group(kafka, group, [w.topic], timeout=5), "records were left in the group"


def test_a_delta_table_written_with_application_transactions_gets_every_record_once(spark, kafka, tmp_path):
    """A real Delta table (delta-rs), written as Databricks' ``txnAppId``/``txnVersion`` writes are: each batch
    appends in a transaction that records (query id, batch id), and a batch id the table already has is
    skipped. foreachBatch raises right after batch 1's commit to the table, before Spark's commit log; the
    restart runs batch 1 again, which must carry the same records (the table skips it) and nothing else."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    # One partition: each batch is one poll of one consumer. (A batch of two polls of one partition, which the
    # embedded broker sometimes hands two members at first, comes back partly: docs/guarantees.md.)
    w = Workload(kafka, "delta", partitions=1)
    w.produce(400)
    group, ck, table = kafka.group(gid()), str(tmp_path / "ck"), str(tmp_path / "orders")
    crashes = [RuntimeError("crash after the Delta commit, before Spark's commit log")]

    def to_delta(df, batch_id):
        app = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        done = DeltaTable(table).transaction_version(app) if DeltaTable.is_deltatable(table) else None
        if done is not None and done >= batch_id:
            return  # this batch id is in the table already
        rows = df.select("topic", "partition", "offset", "value").toArrow()
        write_deltalake(table, rows, mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction(app_id=app, version=batch_id)]))
        if batch_id == 1 and crashes:
            raise crashes.pop()

    def run():
        return spark_share.drain(read_stream(spark, kafka, group, w.topic, readMode="driver", maxRecordsPerTrigger=100)
                                 .writeStream.foreachBatch(to_delta).option("checkpointLocation", ck))

    q = run()
    with pytest.raises(Exception, match="crash after the Delta commit"):
        q.awaitTermination(180)
    q = run()
    assert q.awaitTermination(180)
    assert q.exception() is None
    assert q.recentProgress[0]["batchId"] == 1, "the restart should run batch 1 again"
    written = DeltaTable(table).to_pyarrow_table().to_pylist()
    report = check_no_loss(w.ids, ids_of(written))
    assert report.duplicates == 0, report


def test_committed_records_that_come_back_after_the_next_run_ended_are_never_emitted(kafka):
    """Spark 4.1 runs a declarative pipeline's update as one batch and calls no ``commit()``: each run
    acknowledges nothing, and the next one ACCEPTs the batch before it as its records come back. Records of
    that batch that do not come back during the next run (its one poll filled with another partition's
    records here; a consumer still joining in a pipeline) must still be ACCEPTed by the run after it, which
    knows only the batch before its own."""
    w = Workload(kafka, "pending", partitions=2)
    w.produce(400)
    group = kafka.group(gid())
    end0, first = stopped_run(kafka, group, w.topic)  # Spark committed batch 0; nothing acknowledged it
    assert sorted(first) == sorted(w.ids)
    w.produce(200)  # 100 more on each partition, after batch 0's

    one = reader_for(kafka, group, w.topic, numPartitions="1", maxRecordsPerTrigger="300")
    try:
        one.initialOffset()
        end1 = one.latestOffset(end0, one.getDefaultReadLimit())  # one poll: a partition's 200 of batch 0, 100 new
        second = read(one, end0, end1)
    finally:
        one.stop()  # Spark committed batch 1 too, and called no commit()
    assert second and not set(second) & set(first)
    later = set(w.ids) - set(first) - set(second)

    reader = reader_for(kafka, group, w.topic)
    try:
        reader.initialOffset()
        rest = drain(reader, end1, later)
    finally:
        reader.stop()
    assert not set(rest) & set(first), f"{len(set(rest) & set(first))} records of the committed batch 0 were emitted"
    assert not set(rest) & set(second), "records of the committed batch 1 were emitted"
    assert check_no_loss(w.ids, first + second + rest).duplicates == 0
    assert not drain_share_group(kafka, group, [w.topic], timeout=5), "records were left in the group"
