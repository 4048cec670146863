"""Recovery at the broker's pace: records past Kafka 4.2's delivery throttle, drained by kafka-share and
by raw share-consumer loops on the same state (each in a group of its own), side by side in one run.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python benchmarks/recovery.py --kafka-start tests/harness/kafka_dist/start.sh [--rounds 2]
    .venv/bin/python benchmarks/recovery.py --bootstrap-servers broker:9092 [--kafka-option K=V ...]

For each way of getting there (``--how``: ``expired``, each delivery held past its lock; ``lost``, a
consumer killed holding its poll; ``released``, a consumer that gives every record back;
tests/harness/throttle.py), ``--deliveries`` times (3, Kafka's throttle threshold for its default
delivery limit of 5; 4: the drain is the records' last attempt), on a topic of ``--records`` records on
``--partitions`` partitions, and ``--newer`` records produced once the state is built (they wait behind
the throttled ones in their partitions):

- a raw loop with 1 consumer, and with as many consumers as kafka-share has read slots (``--slots``):
  poll, ACCEPT, commit_sync;
- kafka-share, ``spark_share.drain()`` with ``numPartitions`` = ``--slots``, into foreachBatch.

Prints, per state: records/s of each (from its first record: kafka-share from its first batch with
rows, the group join aside), kafka-share's ratio to the raw loops, how long the first newer record came
after the first record, batches and records per batch, and the delivery counts seen.
Writes results.json to ``--out``. The drain runs under a ``--lock-ms`` record lock (the states are built
under a 2 s one). Not part of the test run. It must never drain two readers from one group's state (each
has a group of its own, built the same way), nor rate kafka-share from its query's start (the group join
is not the drain).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

from bench_common import local_session, parse_args, real_cluster, write_json
from bench_runs import share_stream

from harness.kafka_cluster import add_cluster_arguments
from harness.throttle import HOW, bring_past_throttle, producer_offsets, raw_drain

STATE_LOCK_MS = 2000


def share_drain(spark, kafka, topic: str, group: str, slots: int, newer: set, tmp: str) -> dict:
    """kafka-share drains the state of the group named ``group`` (a name ``kafka.group`` maps): rate over
    the records there, and when the first newer one came."""
    import spark_share

    seen: list[tuple[float, list]] = []

    def collect(df, batch_id):
        rows = [(r["partition"], r["offset"], r["deliveryCount"]) for r in df.select(
            "partition", "offset", "deliveryCount").collect()]
        if rows:
            seen.append((time.monotonic(), rows))

    r = share_stream(spark, kafka, topic, group=group, numPartitions=slots)  # readMode=executors, as measured
    started = time.monotonic()
    q = spark_share.drain(r.load().writeStream.foreachBatch(collect)
                          .option("checkpointLocation", os.path.join(tmp, uuid.uuid4().hex)))
    q.awaitTermination()
    rows = [row for _, batch in seen for row in batch]
    counts: dict[int, int] = {}
    for row in rows:
        counts[row[2]] = counts.get(row[2], 0) + 1
    sizes = [len(batch) for _, batch in seen]
    # As the raw loops' from their first record: from the end of the first batch with rows.
    first = seen[0][0] if seen else started
    span = (seen[-1][0] - first) if len(seen) > 1 else 0.0
    firsts = [t for t, batch in seen for row in batch if (row[0], row[1]) in newer]
    return {"records": len(rows), "seconds": span, "rate": sum(sizes[1:]) / span if span else float("inf"),
            "first_newer_s": (min(firsts) - first) if firsts else None, "batches": len(sizes),
            "mean_batch": statistics.mean(sizes) if sizes else 0, "delivery_counts": dict(sorted(counts.items())),
            "query_start_to_first_rows_s": first - started}


def one_state(spark, kafka, args, how: str, tmp: str) -> dict:
    client = kafka.client()
    topic = kafka.create_topic(f"t-{uuid.uuid4().hex[:6]}", args.partitions)
    producer_offsets(client, topic, args.records, args.partitions)
    kafka.set_record_lock_duration(STATE_LOCK_MS)
    names = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in ("raw1", "rawN", "share")}
    groups = {name: kafka.group(n) for name, n in names.items()}  # kafka.group(n) later: the same id
    built = {name: bring_past_throttle(client, g, topic, args.records, how, args.deliveries, STATE_LOCK_MS / 1000)
             for name, g in groups.items()}
    newer = set(producer_offsets(client, topic, args.newer, args.partitions))
    kafka.set_record_lock_duration(args.lock_ms)
    total = args.records + args.newer
    out = {"how": how, "built": built, "lock_ms": args.lock_ms}
    out["raw1"] = raw_drain(client, groups["raw1"], topic, total, 1, args.timeout, newer)
    out["rawN"] = raw_drain(client, groups["rawN"], topic, total, args.slots, args.timeout, newer)
    out["share"] = share_drain(spark, kafka, topic, names["share"], args.slots, newer, tmp)
    return out


def report(results: dict) -> None:
    print(f"\nRecovery: {results['records']:,} records delivered {results['deliveries']} times before, on "
          f"{results['partitions']} partitions, "
          f"{results['newer']:,} newer ones behind them; kafka-share with {results['slots']} read slots")
    head = f"{'state':<10}{'raw 1/s':>10}{'raw N/s':>10}{'share/s':>10}{'share/rawN':>12}{'share/raw1':>12}" \
           f"{'newer wait s (raw N / share)':>32}{'batches':>9}{'per batch':>11}"
    print(head)
    for how, rounds in results["states"].items():
        raw1 = statistics.median(r["raw1"]["rate"] for r in rounds)
        rawn = statistics.median(r["rawN"]["rate"] for r in rounds)
        share = statistics.median(r["share"]["rate"] for r in rounds)
        waits = [(r["rawN"]["first_newer_s"], r["share"]["first_newer_s"]) for r in rounds]
        wait = "; ".join(f"{a:.1f} / {b:.1f}" if a is not None and b is not None else f"{a} / {b}" for a, b in waits)
        batches = statistics.median(r["share"]["batches"] for r in rounds)
        per = statistics.median(r["share"]["mean_batch"] for r in rounds)
        print(f"{how:<10}{raw1:>10.1f}{rawn:>10.1f}{share:>10.1f}{share / rawn:>12.2f}{share / raw1:>12.2f}"
              f"{wait:>32}{batches:>9.0f}{per:>11.1f}")
        for r in rounds:
            print(f"   built {r['built']}; delivery counts raw {r['rawN']['delivery_counts']}, "
                  f"share {r['share']['delivery_counts']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_arguments(ap)
    ap.add_argument("--how", default=",".join(HOW), help=f"comma-separated, of {', '.join(HOW)}")
    ap.add_argument("--deliveries", type=int, default=3,
                    help="deliveries before the drain (3: past Kafka's throttle; 4: the drain is the last attempt)")
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--newer", type=int, default=200)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--lock-ms", type=int, default=30_000)
    ap.add_argument("--timeout", type=float, default=900.0, help="per raw drain")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="bench-out/recovery")
    args = parse_args(ap, argv)
    spark = local_session()
    tmp = tempfile.mkdtemp(prefix="bench-recovery-")
    results = {"records": args.records, "deliveries": args.deliveries, "newer": args.newer,
               "partitions": args.partitions, "slots": args.slots,
               "states": {}}
    try:
        with real_cluster(args, {"group.share.min.record.lock.duration.ms": "1000"}, "spark-share-recovery") as kafka:
            for _ in range(args.rounds):
                for how in args.how.split(","):
                    results["states"].setdefault(how, []).append(one_state(spark, kafka, args, how, tmp))
    finally:
        spark.stop()
    write_json(os.path.join(args.out, "results.json"), results)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
