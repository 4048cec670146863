"""Recovery at the broker's pace (real Kafka 4.2): records past the delivery throttle, drained by
kafka-share and, on the same state in groups of their own, by raw share-consumer loops.

Kafka 4.2 throttles records delivered three times (of the default limit of five): a fetch acquires only a
few of them, nothing behind them in their partition (tests/harness/throttle.py). A share consumer may
not poll again before it acknowledges, and kafka-share acknowledges only after Spark's commit, so each
of its consumers brings one such fetch per batch; the newer records of those partitions wait behind
them. The test asserts what must hold (every record, once; newer records within one record lock) and
prints the rates side by side; benchmarks/recovery.py measures them over rounds and states
(docs/performance.md)."""
from __future__ import annotations

import time

import pytest

import spark_share
from harness.support import check_no_loss, gid, read_stream, uid
from harness.throttle import bring_past_throttle, producer_offsets, raw_drain

pytestmark = [pytest.mark.slow,
              pytest.mark.real_only("Kafka 4.2's delivery throttle: the embedded broker has none")]

STATE_LOCK_MS = 2000  # the state is built under a short lock (expiries), drained under the test's lock
DRAIN_LOCK_S = 30
RECORDS, NEWER, PARTITIONS, SLOTS = 200, 100, 2, 2
DELIVERIES = 4  # the drain is their last attempt (of Kafka's default 5): the broker hands them out one a fetch


def test_records_past_the_throttle_drain_at_the_brokers_pace(spark, kafka, tmp_path):
    client = kafka.client()
    topic = kafka.create_topic(uid("throttled"), PARTITIONS)
    old = producer_offsets(client, topic, RECORDS, PARTITIONS)
    kafka.set_record_lock_duration(STATE_LOCK_MS)
    groups = {name: kafka.group(gid()) for name in ("raw1", "rawN", "share")}
    # Delivered four times, each held past its lock (a batch that outlived it).
    built = {name: bring_past_throttle(client, g, topic, RECORDS, "expired", DELIVERIES, STATE_LOCK_MS / 1000)
             for name, g in groups.items()}
    newer = set(producer_offsets(client, topic, NEWER, PARTITIONS))
    kafka.set_record_lock_duration(DRAIN_LOCK_S * 1000)
    raw1 = raw_drain(client, groups["raw1"], topic, RECORDS + NEWER, 1, 300, newer)
    rawn = raw_drain(client, groups["rawN"], topic, RECORDS + NEWER, SLOTS, 300, newer)

    arrivals: list[tuple[float, list]] = []

    def collect(df, batch_id):
        arrivals.append((time.monotonic(), df.select("partition", "offset", "deliveryCount", "value").collect()))

    started = time.monotonic()
    q = spark_share.drain(read_stream(spark, kafka, groups["share"], topic, numPartitions=SLOTS).writeStream
                          .foreachBatch(collect).option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(600), "the drain did not end"
    assert q.exception() is None
    rows = [r for _, batch in arrivals for r in batch]
    seen = [(r["partition"], r["offset"]) for r in rows]
    report = check_no_loss(old + sorted(newer), seen)
    assert report.duplicates == 0, report
    with_rows = [(t, batch) for t, batch in arrivals if batch]
    first = with_rows[0][0]  # from the end of the first batch with rows, as the raw loops from their first record
    after_first = sum(len(b) for _, b in with_rows[1:])
    share_rate = after_first / max(1e-9, with_rows[-1][0] - first)
    first_newer = min(t for t, batch in arrivals for r in batch if (r["partition"], r["offset"]) in newer)
    counts = sorted({r["deliveryCount"] for r in rows if (r["partition"], r["offset"]) not in newer})
    print(f"past the throttle ({built['share']} acquired per round; delivery counts at the drain {counts}): "
          f"kafka-share {share_rate:.1f} records/s after its first batch, first newer record "
          f"{first_newer - started:.1f} s after the query started, {len(with_rows)} batches with rows; raw loop "
          f"(from its first record), 1 consumer {raw1['rate']:.1f}/s, newer after {raw1['first_newer_s']} s; "
          f"{SLOTS} consumers {rawn['rate']:.1f}/s, newer after {rawn['first_newer_s']} s: kafka-share / raw "
          f"{SLOTS} = {share_rate / rawn['rate']:.2f}")
    assert max(counts) > DELIVERIES, f"the state was not past the throttle (delivery counts {counts}): the test proves nothing"
    assert first_newer - started <= DRAIN_LOCK_S, (
        f"the newer records waited {first_newer - started:.1f} s behind the throttled ones, more than one "
        f"record lock ({DRAIN_LOCK_S} s)")
