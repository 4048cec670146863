"""A partition shared by several of the query's consumers, as Kafka shares one between the members of a share
group when they outnumber its partitions. The embedded broker's assignor gives a partition to one member, so
there both of the query's consumers are assigned it by hand (``ShareGroups.assign``, the mock's target
assignment); on real Kafka the broker shares it by itself."""
from __future__ import annotations

import threading

from pyspark.sql import functions as F

from harness.support import ShareGroups, Workload, check_no_loss, gid, id_col, read_stream, source_progress, wait_until


def test_a_partition_shared_by_the_querys_consumers_is_read_once_and_acknowledged_by_its_acquirers(
        spark, kafka, tmp_path):
    """One partition, two read slots, 100 records a batch: both consumers acquire from the partition in the same batches (their
    offsets interleave), every record reaches the sink once, and each is acknowledged by the consumer that
    acquired it (no acknowledgement fails)."""
    if not kafka.external:
        kafka.set_heartbeat_interval(200)  # the members learn the manual assignment within ~0.2 s
    w = Workload(kafka, "shared", partitions=1)
    group = kafka.group(gid())
    rows: list[tuple[int, int, int]] = []  # (batch, task, id)
    lock = threading.Lock()

    def keep(df, batch_id):
        got = df.select(F.spark_partition_id().alias("task"), id_col().alias("id")).collect()
        with lock:
            rows.extend((batch_id, r["task"], r["id"]) for r in got)

    q = (read_stream(spark, kafka, group, w.topic, numPartitions=2, pollTimeoutMs=500, maxRecordsPerTrigger=100).writeStream
         .foreachBatch(keep).option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="500 milliseconds")
         .start())
    try:
        if not kafka.external:
            groups = ShareGroups(kafka)
            wait_until(lambda: len(groups.members(group)) == 2, timeout=60, message="the query's two consumers joined")
            groups.assign(group, {m: [(w.topic, 0)] for m in groups.members(group)})
        for _ in range(40):  # small sends: a fetch hands out whole record batches, several per poll
            w.produce(25)
        wait_until(lambda: {i for _, _, i in rows} >= set(w.ids) or q.exception() is not None, timeout=120,
                   message="the stream did not read every record")
        assert q.exception() is None, q.exception()
    finally:
        q.stop()
    report = check_no_loss(w.ids, [i for _, _, i in rows])
    assert report.duplicates == 0, report
    tasks_per_batch: dict[int, set[int]] = {}
    for batch, task, _ in rows:
        tasks_per_batch.setdefault(batch, set()).add(task)
    shared = [b for b, tasks in tasks_per_batch.items() if len(tasks) == 2]
    print(f"batches in which both consumers read the partition: {len(shared)} of {len(tasks_per_batch)}")
    assert shared, f"the partition was never read by both consumers in one batch: {tasks_per_batch}"
    assert source_progress(q)["failed"] == 0, "an acknowledgement failed: sent by a consumer that did not acquire"
