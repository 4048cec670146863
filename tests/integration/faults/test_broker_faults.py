"""Fault matrix: the broker fails (rows 7, 8 and 9).

Row 7: ShareFetch errors (retriable, fatal) and a partition leader moving (embedded broker only).
Row 8: the ShareAcknowledge of a batch fails: its records come back, the failure is counted and
logged with its error code (embedded broker only). Row 9: the broker is down for 3 s right after a
batch wrote (embedded: down/up; real Kafka: a stop and a start on the same data directory)."""
from __future__ import annotations

import re

import pytest

from harness.brokers import EmbeddedBroker
from harness.support import (
    BatchCollector,
    Workload,
    broker_outage,
    check_no_loss,
    gid,
    run_available_now,
    source_progress,
    tracker_log,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
@pytest.mark.embedded_only("injects ShareFetch errors and moves a partition's leader")
@pytest.mark.parametrize("inject", ["retriable", "fatal", "leader_move"])
def test_row7_share_fetch_errors(spark, tmp_path, inject):
    with EmbeddedBroker(brokers=2) as kafka:
        w = Workload(kafka, "r7", partitions=2)
        w.produce(300)
        kafka.track_requests()
        if inject == "retriable":
            kafka.push_request_errors("ShareFetch", [6, 6, 7])  # NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT
        elif inject == "fatal":
            kafka.push_request_errors("ShareFetch", [29])  # TOPIC_AUTHORIZATION_FAILED, once
        moved = []

        def process(df, batch_id):
            collector(df, batch_id)
            if inject == "leader_move" and not moved:
                kafka.move_leader(w.topic, 0, 2)
                moved.append(True)
                w.produce(100)

        collector = BatchCollector()
        q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, process, str(tmp_path / "ck"))
        assert q.exception() is None
        if inject == "leader_move":
            assert moved == [True]
        else:  # the injected errors were served: more ShareFetch requests came than errors were queued
            assert kafka.request_count("ShareFetch") > {"retriable": 3, "fatal": 1}[inject]
        check_no_loss(w.ids, collector.ids, duplicates_reason="share sessions reset by the injected fault")


@pytest.mark.both_read_modes
@pytest.mark.embedded_only("injects ShareAcknowledge errors")
def test_row8_share_acknowledge_errors(spark, kafka, tmp_path, read_mode):
    """The acknowledgement of batch 0 fails: the records come back, the failure is counted and
    logged with its error code, nothing is lost. Spark committed batch 0: in readMode=driver its records
    are ACCEPTed when they come back, never written again; readMode=executors writes them again."""
    w = Workload(kafka, "r8", partitions=1)
    w.produce(100)

    def fail_the_ack(df, batch_id, rows):
        if batch_id == 0:
            kafka.push_request_errors("ShareAcknowledge", [29])

    collector = BatchCollector(after=fail_the_ack)
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, collector, str(tmp_path / "ck"))
    assert q.exception() is None
    p = source_progress(q)
    assert "'TOPIC_AUTHORIZATION_FAILED(29)': 100" in tracker_log(q)
    if read_mode == "driver":
        report = check_no_loss(w.ids, collector.ids)
        assert report.duplicates == 0, report
        assert p["failed"] == 100 and p.get("acceptedAgain") == 100, p
        return
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="batch 0 came back after its ack failed")
    assert report.duplicates == 100
    assert {r["deliveryCount"] for b, rows in collector.batches.items() if b > 0 for r in rows} == {2}
    assert p["failed"] == 100 and p["accepted"] == 100


@pytest.mark.both_read_modes
def test_row9_broker_down_while_records_are_acquired(spark, kafka, tmp_path):
    """The broker goes away for 3 s right after batch 0 wrote (embedded: down/up; real Kafka: a clean
    stop and a start on the same data directory): batch 0's acknowledgement waits for it or fails and
    its records come back; nothing is lost."""
    w = Workload(kafka, "r9", partitions=2)
    w.produce(200)
    timers = []

    def outage(df, batch_id, rows):
        if batch_id == 0:
            timers.append(broker_outage(kafka, 3.0))

    collector = BatchCollector(after=outage)
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, collector, str(tmp_path / "ck"),
                          ackTimeoutMs=10000)
    for t in timers:
        t.join()
    assert q.exception() is None
    # Batch 0's acknowledgement met the outage: it was held until the broker came back, or failed.
    line = re.search(r"spark-share batch 0 \(group [^)]+\): .*", tracker_log(q)).group(0)
    latency = int(re.search(r"ack latency (\d+) ms", line).group(1))
    assert latency >= 1000 or "errors" in line, line
    check_no_loss(w.ids, collector.ids, duplicates_reason="records whose ack was lost with the broker")
