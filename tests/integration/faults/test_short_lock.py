"""Fault matrix: a batch outlives its record lock (row 10).

A 3 s lock and 10 ms of work per record: the first batch's locks expire; the expiry is counted and
logged with advice, later batches shrink until they fit, nothing is lost (invariant 4), and in readMode=driver
nothing of the committed batch is written again."""
from __future__ import annotations

import re
import time

import pytest

from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    gid,
    run_available_now,
    source_progress,
    tracker_log,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row10_batch_outlives_the_lock_and_batches_shrink(spark, kafka, tmp_path, read_mode):
    """Lock 3 s, processing 10 ms per record: the first batch (400 records) outlives its lock. The expiry is
    counted and logged with advice, later batches shrink until they fit, nothing is lost; in readMode=driver
    the expired records of the committed batch come back and are ACCEPTed, not written again."""
    kafka.set_record_lock_duration(3000)
    w = Workload(kafka, "r10", partitions=1)
    w.produce(1200)  # the first batches outlive their lock; what is left shows the later, smaller ones fit

    def slow(df, batch_id):
        rows = df.collect()
        time.sleep(0.01 * len(rows))  # the work: proportional to the batch
        collector.batches.setdefault(batch_id, []).extend(rows)
        collector.rows.extend(rows)

    collector = BatchCollector()
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, slow, str(tmp_path / "ck"),
                          maxRecordsPerTrigger=400)
    assert q.exception() is None
    sizes = [len(collector.batches[b]) for b in sorted(collector.batches)]
    p = source_progress(q)
    assert p["expired"] >= 1, f"no expiry detected; batch sizes {sizes}"
    assert p["maxRecordsPerConsumer"] is not None and p["maxRecordsPerConsumer"] * 0.01 < 3
    assert max(sizes[1:]) <= p["maxRecordsPerConsumer"] * 2, sizes
    log = tracker_log(q)
    assert "locks expired before the batch committed" in log and "share.record.lock.duration.ms" in log
    expired = [int(n) for n in re.findall(r"spark-share batch \d+ \(group [^)]+\): acquired \d+, accepted \d+, "
                                          r"released \d+, rejected \d+, expired (\d+)", log)]
    assert log.count("locks expired before the batch committed") == sum(1 for n in expired if n), "not once per batch"
    # The expiry is behind the run: the batches after the smaller size took effect kept their locks.
    assert expired[0] > 0 and expired[-1] == 0, f"expiries did not stop once batches shrank: {expired}"
    if read_mode == "driver":
        # Spark committed the first batch: its records whose ACCEPT came too late come back to this run and
        # are ACCEPTed there, never emitted again.
        report = check_no_loss(w.ids, collector.ids)
        assert report.duplicates == 0, report
        assert p["acceptedAgain"] >= 1 and "ACCEPTed when the broker delivers them again" in log, p
    else:  # executors: at least once, the expired records are written again
        check_no_loss(w.ids, collector.ids, duplicates_reason="records whose lock expired in the first batch")
