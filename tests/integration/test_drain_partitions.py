"""A drain reads every partition of what was queued at its start, not only the partitions its read tasks
happened to poll (issue 41: a drain on three hosts ended, with no error, having read nothing of one of
four partitions; its member was polled by no read task of the batches that found nothing).

A drain ends on an empty batch only once every partition with records below the start's high watermark
was seen through it or answered empty by a poll of the query's own; one that no consumer of the query
is given waits (a bounded time) and shows in ``status()["drain"]``."""
from __future__ import annotations

import json
import time

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    IdleMember,
    Workload,
    check_no_loss,
    drive_available_now,
    gid,
    read_stream,
    source_options,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_a_drain_waits_for_partitions_no_poll_of_its_own_answered(spark, kafka, tmp_path):
    """A member that holds partitions and is never polled (here one outside the query, which joined
    first) leaves them unread by every read task: the old end test took the first empty batch for an
    empty queue and the drain ended with those partitions unread. Now the drain waits, says which
    partitions it waits for, and reads them once the member is gone (the broker hands them to the
    query's consumers)."""
    topic = kafka.create_topic("held", 4)
    group = kafka.group(gid())
    idle = IdleMember(kafka, group, topic)
    closed = False
    w = Workload(kafka, topic, partitions=4, create=False)
    w.produce(400)
    collector = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, group, topic, numPartitions=2).writeStream
                          .foreachBatch(collector).option("checkpointLocation", str(tmp_path / "ck")))
    try:
        def waiting() -> dict | None:
            if not q.isActive:
                return {"ended": True}
            try:
                status = spark_share.status(q)
            except spark_share.VerdictError:  # not registered before its first read task
                return None
            drain = status.get("drain") or {}
            # After a batch that found nothing (where the old end test ended the run) the drain still
            # waits for the idle member's partitions.
            waited = any(b["state"] == "acked" and not b["acquired"] for b in status["batches"])
            return drain if drain.get("unresolvedCount") and collector.rows and waited else None

        seen = wait_until(waiting, timeout=90, message="the drain read nothing, or never waited for a partition")
        assert not seen.get("ended"), (f"the drain ended with {len(set(collector.ids))} of {len(w.ids)} records "
                                       "read, while a member that is never polled held partitions")
        held = {int(name.rsplit("-", 1)[1]) for name in seen["unresolved"]}
        read = {r["partition"] for r in collector.rows}
        print(f"the drain waits for partitions {sorted(held)} (held by the idle member); it read partitions "
              f"{sorted(read)} meanwhile")
        assert held and not held & read, (held, read)
        idle.close()
        closed = True
        assert q.awaitTermination(120), "the drain did not end once the idle member left"
        assert q.exception() is None, q.exception()
    finally:
        if not closed:
            idle.close()
        if q.isActive:
            q.stop()
    # The idle member's departure ends every share session on the embedded broker (its quirk): what the
    # query held then comes back, so duplicates are allowed there, never a loss.
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="the idle member left mid-drain")
    if kafka.external:
        assert report.duplicates == 0, report
    assert not spark_share.status(q).get("drain", {}).get("leftUnread"), "the drain gave up on a partition"


def test_a_drain_says_which_partitions_it_left_when_no_poll_of_its_own_is_given_them(kafka, monkeypatch):
    """The wait is bounded: a member that never leaves (another query on the same group, say) keeps its
    partitions, and the drain ends after AVAILABLE_NOW_UNRESOLVED_S (shortened here: the reader runs in
    this process, driven as Spark drives it) naming them in its log and status(), having read the rest."""
    from spark_share.driver import drain_policy

    monkeypatch.setattr(drain_policy, "AVAILABLE_NOW_UNRESOLVED_S", 6.0)
    topic = kafka.create_topic("kept", 4)
    group = kafka.group(gid())
    idle = IdleMember(kafka, group, topic)
    try:
        w = Workload(kafka, topic, partitions=4, create=False)
        w.produce(200)
        t0 = time.monotonic()
        run = drive_available_now(source_options(kafka, group, topic, numPartitions=2), timeout=90)
        took = time.monotonic() - t0
    finally:
        idle.close()
    read = {r["partition"] for r in run.rows}
    left = run.status["drain"]["leftUnread"]
    print(f"ended after {took:.1f} s, having left partitions {left} to the member that holds them; read {sorted(read)}")
    assert left and not {int(n.rsplit("-", 1)[1]) for n in left} & read
    assert took >= 6, f"the drain ended after {took:.1f} s, before its bound"
    warning = next((line for line in run.log.splitlines() if "the drain ends with" in line), "")
    assert "WARNING" in warning and left[0] in warning, run.log[-3000:]


def test_a_drain_of_two_thousand_partitions_reads_every_record_once(spark, kafka, tmp_path):
    """Thousands of partitions: every record read once, the progress each batch reports stays small (Spark
    logs every report), and the time is measured against the same records on 8 partitions."""
    took, progress = {}, {}
    for run, partitions in enumerate((8, 2000, 8)):  # the first run pays for Spark's first jobs: not counted
        w = Workload(kafka, f"wide-{run}-{partitions}", partitions=partitions)
        w.produce(8000)
        collector = BatchCollector()
        t0 = time.monotonic()
        q = spark_share.drain(read_stream(spark, kafka, kafka.group(gid()), w.topic).writeStream
                              .foreachBatch(collector).option("checkpointLocation", str(tmp_path / f"ck{run}")))
        assert q.awaitTermination(300), f"the drain of {partitions} partitions did not end"
        took[partitions] = time.monotonic() - t0
        assert q.exception() is None, q.exception()
        report = check_no_loss(w.ids, collector.ids)
        assert report.duplicates == 0, report
        progress[partitions] = max(len(json.dumps(p["sources"][0]["latestOffset"])) for p in q.recentProgress)
    print(f"8,000 records: {took[8]:.1f} s on 8 partitions, {took[2000]:.1f} s on 2,000 "
          f"({took[2000] / took[8]:.1f}x); progress reports at most {progress[8]} and {progress[2000]} bytes")
    assert progress[2000] < 16 << 10, f"a progress report of {progress[2000]} bytes"


def test_the_progress_stays_small_at_ten_thousand_partitions_and_status_has_them_all(kafka):
    """Every progress report carried the whole per-partition backlog (185 KB at 2,000 partitions on real
    Kafka): now the totals and the partitions with the most backlog; status() has every partition."""
    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options

    topic = kafka.create_topic("ten-thousand", 10_000)
    w = Workload(kafka, topic, partitions=10_000, create=False)
    w.produce(20_000)
    t = Tracker(parse_options(source_options(kafka, kafka.group(gid()), topic)))
    try:
        t.policy.max_seen.update({(topic, p): 0 for p in range(10_000)})  # as if each was read once
        t.metadata.refresh()
        t._estimate_backlog()
        progress, status = json.dumps(t.progress()), t.status()
    finally:
        t.shutdown()
    print(f"10,000 partitions: a progress report of {len(progress)} bytes; status() names {len(status['backlog'])}")
    assert len(progress) < 16 << 10
    assert len(status["backlog"]) == 10_000 and status["backlogEstimate"] == 20_000 - 10_000
    assert len(json.loads(progress)["backlogTop"]) == 10
