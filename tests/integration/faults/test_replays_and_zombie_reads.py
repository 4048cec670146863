"""Fault matrix: a batch id that cannot be served with its first rows (rows 13, 14 and 15).

Row 13: a crash after an idempotent writer wrote and before Spark's commit; Spark replays the batch
id after the restart and it carries that batch's own records again (readMode=driver) or nothing
(readMode=executors), so the writer that skips it loses nothing. Row 14: an
action on a batch DataFrame long after the batch committed (a zombie read) fails clearly and
acquires nothing. Row 15: the file sink committed, Spark's commit log did not (commits/0 removed):
the replay reads nothing and the records produced meanwhile come with the next batch (invariant 9).
The last test pins the tracker's refusals those rows rely on."""
from __future__ import annotations

import os

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    drain_share_group,
    gid,
    ids_of,
    read_stream,
    registry,
    source_progress,
    wait_until,
)
from spark_share.errors import BatchRefused
from spark_share.transport.protocol import Claim

from .helpers import StubAgent, acquired, tracker

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row13_a_replayed_batch_carries_its_own_records_so_an_idempotent_writer_loses_nothing(spark, kafka, tmp_path,
                                                                                             read_mode):
    """foreachBatch counts the batch, skips a batch id it already wrote (Delta's txnAppId/txnVersion)
    and otherwise writes. Run 1 writes batch 0 and fails before Spark's commit: batch 0 is released,
    and another member of the group processes part of it. Spark replays batch 0 after the restart:
    new records under that id would be skipped by the writer and then ACCEPTed (lost). readMode=driver: it
    carries batch 0's own records that the other member did not take, and the writer writes none twice;
    readMode=executors: it reads nothing, and batch 0's records come back in a later batch."""
    w = Workload(kafka, "replay", partitions=2)
    w.produce(400)
    group, ck = kafka.group(gid()), str(tmp_path / "ck")
    written = {}  # batch id -> ids: the idempotent writer's table
    crashes = [RuntimeError("crash after the write, before Spark's commit")]

    def idempotent_write(df, batch_id):
        print(f"batch {batch_id}: {df.count()} rows")
        if batch_id in written:
            return
        written[batch_id] = ids_of(df.collect())
        if crashes:
            raise crashes.pop()

    q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="crash after the write"):
        q.awaitTermination(120)
    assert len(written[0]) > 100
    other = drain_share_group(kafka, group, [w.topic], timeout=30, until=100, max_poll_records=100)
    taken = ids_of({"value": v} for _, _, _, _, v in other)
    assert 0 < len(taken) < len(written[0]), "the other member should take part of the released batch"
    w.produce(200)
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck))
    assert q.awaitTermination(180)
    assert q.exception() is None
    replay = q.recentProgress[0]
    sink = [i for ids in written.values() for i in ids]
    if read_mode == "driver":
        # Batch 0 again: the records its offset names that the other member did not take, nothing else; the
        # ones it took are counted, and only they are in two places.
        assert (replay["batchId"], replay["numInputRows"]) == (0, len(written[0]) - len(taken)), replay
        assert source_progress(q).get("replayMissing") == len(taken)
        report = check_no_loss(w.ids, sink + taken, duplicates_reason="batch 0's rows the other member took")
        # The embedded broker ends every share session when a client disconnects (the failed run's, closing
        # after its tracker ended): the replayed batch's acknowledgement may fail there, and its records come
        # back once more. Real Kafka: only the other member's records are in two places.
        assert report.duplicates == len(taken) if kafka.external else report.duplicates <= len(written[0]), report
    else:  # the records are acquired in the read tasks, after the offset is written: the replay reads nothing
        assert (replay["batchId"], replay["numInputRows"]) == (0, 0), "the replayed batch 0 read records"
        report = check_no_loss(w.ids, sink + taken, duplicates_reason="batch 0's rows, written before the crash, "
                               "came back once (to the other member or to a later batch)")
        assert report.duplicates <= len(written[0])


@pytest.mark.both_read_modes
def test_row14_an_action_on_a_batch_after_it_committed_acquires_nothing(spark, kafka, tmp_path, read_mode):
    """A batch DataFrame kept and read again 25 batches later (as a zombie task attempt would) acquires
    nothing; before, it polled new records under the old batch id and the next commit ACCEPTed them
    unseen. With readMode=executors it fails clearly (the agents no longer hold the rows); with
    readMode=driver it gets the batch's own rows again: they are in its task payloads."""
    w = Workload(kafka, "kept", partitions=1)
    w.produce(60)
    kept, late = {}, []
    collector = BatchCollector()

    def process(df, batch_id):
        collector(df, batch_id)
        if batch_id == 0:
            kept["df"], kept["rows"] = df, df.count()
        if batch_id == 25:
            try:
                late.append(kept["df"].count())
            except Exception as e:
                late.append(str(e))

    q = spark_share.drain(read_stream(spark, kafka, kafka.group(gid()), w.topic, maxRecordsPerTrigger=2).writeStream
         .foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(180)
    assert q.exception() is None
    if read_mode == "driver":
        assert late == [kept["rows"]] and kept["rows"] > 0, f"the late action returned {late}, not batch 0's rows"
    else:
        assert len(late) == 1 and isinstance(late[0], str), f"the late action returned {late}"
        assert "already committed and its records acknowledged" in late[0] and "persist()" in late[0], late[0][:2000]
    assert source_progress(q)["acquired"] == 60, "the late action acquired records"
    assert check_no_loss(w.ids, collector.ids).duplicates == 0


@pytest.mark.both_read_modes
def test_row15_the_file_sink_skips_a_replayed_batch_and_loses_nothing(spark, kafka, tmp_path):
    """A crash between the file sink's commit and Spark's commit log (commits/0 removed): Spark
    replays batch 0, the sink skips it without reading, and the records produced meanwhile are
    written by the next batch."""
    w = Workload(kafka, "files", partitions=2)
    w.produce(200)
    group, ck, out = kafka.group(gid()), str(tmp_path / "ck"), str(tmp_path / "out")

    def run(drain: bool):
        writer = (read_stream(spark, kafka, group, w.topic).writeStream.format("parquet").option("path", out)
                  .option("checkpointLocation", ck))
        q = spark_share.drain(writer) if drain else writer.trigger(once=True).start()
        assert q.awaitTermination(120)
        assert q.exception() is None
        return q

    first = run(drain=False)
    # The run's source stops after awaitTermination returns, and its stop reads the commit log: the crash
    # below comes after it (the tracker's registry entry goes last), as a crash after that run would.
    wait_until(lambda: registry(first.id) is None, timeout=30, message="the Trigger.Once run's tracker did not stop")
    assert sorted(f for f in os.listdir(os.path.join(ck, "commits")) if not f.endswith(".crc")) == ["0"]
    for f in ("0", ".0.crc"):  # the crash: Spark never wrote batch 0's commit (nor its checksum)
        os.unlink(os.path.join(ck, "commits", f))
    w.produce(100)
    q = run(drain=True)
    assert q.recentProgress[0]["batchId"] == 0 and q.recentProgress[0]["numInputRows"] == 0
    rows = ids_of(spark.read.parquet(out).collect())
    # Batch 0 was in the commit log when the Trigger.Once run ended: ACCEPTed, not released.
    assert check_no_loss(w.ids, rows).duplicates == 0


def test_reads_of_batches_this_run_cannot_serve_are_refused(kafka):
    t, topic = tracker(kafka, "refused")
    a1, a2 = StubAgent("a1"), StubAgent("a2")
    t.agents.update(a1=a1, a2=a2)
    try:
        assert t.batch_to_read(4) is None, "a batch an earlier run planned (a replay) must read nothing"
        with pytest.raises(BatchRefused, match="planned by an earlier run"):
            t._on_claim(a1, Claim(4, 0))
        with pytest.raises(BatchRefused, match="never planned"):
            t._on_claim(a1, Claim(9, 0))
        b = t.plan(5, None)
        assert t.batch_to_read(5) is b and t._on_claim(a1, Claim(5, 0))["owner"] == "a1"
        acquired(t, a1, 5, 0, topic, 0, 0, 9)
        t.batch_committed(5)
        assert b.state == "acked"
        with pytest.raises(BatchRefused, match="already committed"):
            t._on_claim(a2, Claim(5, 0))
        with pytest.raises(BatchRefused, match="already committed"):
            t._on_claim(a2, Claim(2, 0))  # older than anything kept: finished long ago
        assert t.total_acquired == 10
    finally:
        t.agents.clear()
        t.shutdown()
    with pytest.raises(BatchRefused, match="stopping"):
        t._on_claim(a1, Claim(6, 0))
    assert t.plan(6, None) is None
