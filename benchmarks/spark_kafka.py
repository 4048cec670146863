"""kafka-share beside Spark's own Kafka source (``format("kafka")``) and beside the lock-budget bound, side
by side in one run on a real Kafka, at Kafka's default record locks and at 10,000.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python benchmarks/spark_kafka.py \\
        --kafka-start tests/harness/kafka_dist/start.sh --spark-kafka-jars ~/spark-kafka-jars [--rounds 3] [--out DIR]

``--spark-kafka-jars``: a folder with Spark's Kafka connector for the installed PySpark
(spark-sql-kafka-0-10, spark-token-provider-kafka-0-10, kafka-clients, commons-pool2: what
``--packages org.apache.spark:spark-sql-kafka-0-10_2.13:<version>`` would fetch); spark-share ships none.

One broker per lock setting (``group.share.partition.max.record.locks``), removed after its runs; one
topic of ``--records`` records of 100 bytes on ``--partitions`` partitions; one Spark session
(``local[2]``). Each round, in the reverse order every other round: Spark's source reading the topic
from its earliest offsets, and kafka-share (its defaults: ``readMode=driver``, a fresh share group at
Kafka's default heartbeat), each ``Trigger.AvailableNow`` into the noop sink; then Spark's floor (a Python
source that yields prebuilt rows, bench_floor.py) with kafka-share's batches, tasks and rows.

The bound: a batch holds its records until Spark commits it, so kafka-share reads at most partitions x
locks records per batch time; at Spark's floor batch time (the floor's median batch, same shape) that is
the bound its after-the-first-batch rate is set against. Where a record's lock goes: the tracker's
``phasesMs`` (medians of the full batches after the first). The first rows: the query's start to the end
of its first batch with rows, against the group's heartbeat (5 s, Kafka's default) + 1 s.

Prints the table, with each target and whether it was met, and writes results.json to ``--out``. Not part
of the test run; it must never put figures of two brokers in one ratio.
"""
from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time

from bench_common import backlog, comma_ints, local_session, med, parse_args, real_cluster, write_json
from bench_runs import available_now, batch_end, floor_beside, share_run
from targets import LOCKS_PROP, in_flight

from harness.kafka_cluster import add_cluster_arguments

HEARTBEAT_S = 5.0  # Kafka's group.share.heartbeat.interval.ms: the group join of a query's first batch
# The targets, as ratios: after the first batch / the bound; from start / Spark's source, per locks.
AFTER_FIRST_OF_BOUND = 0.85
FROM_START_OF_SPARK = {2000: 0.5, 10000: 0.8}


def spark_kafka_run(spark, kafka, topic: str, n: int, tmp: str) -> dict:
    """Spark's own source over ``topic`` from its earliest offsets, AvailableNow into the noop sink."""
    r = spark.readStream.format("kafka").option("subscribe", topic).option("startingOffsets", "earliest")
    for k, v in kafka.client().items():
        r = r.option("kafka." + k, v)
    t0, wall0 = time.perf_counter(), time.time()
    q = available_now(r.load().writeStream.format("noop"), tmp)
    q.awaitTermination()
    seconds = time.perf_counter() - t0
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in prog)
    if q.exception() is not None or rows < n:
        raise RuntimeError(f"Spark's Kafka source read {rows:,} of {n:,} records (query exception: {q.exception()})")
    return {"seconds": seconds, "rps": n / seconds, "batches": len(prog),
            "first_row_s": batch_end(prog[0]) - wall0 if prog else None}


def floor_batch_ms(floor: dict) -> float:
    """Spark's floor: the median time of its batches with rows after the first."""
    return statistics.median(p["triggerExecution"] for p in floor["phases"][1:] if p["rows"])


def one_lock_setting(spark, args, locks: int, tmp: str) -> dict:
    from spark_share.driver.policy import default_slots

    budget = args.partitions * locks
    slots = default_slots(args.partitions, "2")
    out: dict = {"locks": locks, "budget": budget, "rounds": []}
    with real_cluster(args, {LOCKS_PROP: str(locks)}, "spark-share-spark-kafka") as kafka:
        topic = backlog(kafka, args.partitions, args.records)
        # Not measured: the topic's first readers (the broker's page cache, the JVM's and workers' start).
        spark_kafka_run(spark, kafka, topic, args.records, tmp)
        share_run(spark, kafka, topic, None, args.records, tmp, readMode="driver")
        for rnd in range(args.rounds):
            got: dict = {}
            for name in ("spark", "share") if rnd % 2 == 0 else ("share", "spark"):
                if name == "spark":
                    got[name] = spark_kafka_run(spark, kafka, topic, args.records, tmp)
                    continue
                run = share_run(spark, kafka, topic, None, args.records, tmp, readMode="driver")
                run.update(in_flight(run, budget))
                got[name] = {k: run[k] for k in ("seconds", "batches", "mean_batch", "first_row_s", "phases")} | {
                    "rps": args.records / run["seconds"], "after_first": run["steady_records"] / run["steady_seconds"],
                    "held_ms": run.get("held_ms"), "phases_ms": run.get("phases_ms"), "expired": run.get("expired")}
            floor = floor_beside(spark, got["share"], slots, args.records, tmp)
            got["floor_batch_ms"] = floor_batch_ms(floor)
            got["bound_rps"] = budget / (got["floor_batch_ms"] / 1000.0)
            out["rounds"].append(got)
            s, k = got["spark"], got["share"]
            print(f"locks {locks} round {rnd + 1}: Spark's source {s['rps']:,.0f}/s ({s['batches']} batches); "
                  f"kafka-share {k['rps']:,.0f}/s from start, {k['after_first']:,.0f}/s after the first batch "
                  f"({k['batches']} batches of {k['mean_batch']:,.0f}), first rows {k['first_row_s']:.1f} s; "
                  f"floor batch {got['floor_batch_ms']:.0f} ms, bound {got['bound_rps']:,.0f}/s; "
                  f"lock held {k['held_ms'] or 0:.0f} ms {k['phases_ms']}", flush=True)
    return out


def report(results: dict) -> None:
    print(f"\n{results['records']:,} records of 100 B on {results['partitions']} partitions; medians of "
          f"{results['rounds']} rounds; PySpark {results['pyspark']}")
    rows = []
    for s in results["settings"]:
        rs, locks = s["rounds"], s["locks"]
        spark = med(r["spark"]["rps"] for r in rs)
        share = med(r["share"]["rps"] for r in rs)
        after = med(r["share"]["after_first"] for r in rs)
        bound = med(r["bound_rps"] for r in rs)
        first = med(r["share"]["first_row_s"] for r in rs)
        want = FROM_START_OF_SPARK.get(locks)
        rows.append((f"{locks:,} locks: from start, kafka-share / Spark's source", f"{share:,.0f} / {spark:,.0f}",
                     share / spark, want))
        rows.append((f"{locks:,} locks: after the first batch / the bound ({s['budget']:,} locks / floor batch "
                     f"{med(r['floor_batch_ms'] for r in rs):.0f} ms)", f"{after:,.0f} / {bound:,.0f}", after / bound,
                     AFTER_FIRST_OF_BOUND if locks == 2000 else None))
        rows.append((f"{locks:,} locks: first rows, s / heartbeat + 1 s", f"{first:.1f} / {HEARTBEAT_S + 1:.0f}",
                     first / (HEARTBEAT_S + 1), None))
        phases = {k: round(med(r["share"]["phases_ms"][k] for r in rs if r["share"]["phases_ms"]))
                  for k in (rs[0]["share"]["phases_ms"] or {})}
        print(f"{locks:,} locks: a record's lock, median ms of the full batches: held "
              f"{med(r['share']['held_ms'] for r in rs if r['share']['held_ms']):.0f}, {phases}")
    print(f"\n{'target':<92} | {'figures':>19} | ratio | goal   | met")
    for what, figures, ratio, goal in rows:
        met = "" if goal is None else ("yes" if ratio >= goal else "no")
        if "first rows" in what:
            goal, met = 1.0, "yes" if ratio <= 1 else "no"
            print(f"{what:<92} | {figures:>19} | {ratio:5.2f} | <= {goal:<3} | {met}")
            continue
        print(f"{what:<92} | {figures:>19} | {ratio:5.2f} | {'>= ' + str(goal) if goal else '-':<6} | {met}")


def main(argv=None) -> int:
    import pyspark

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_arguments(ap)
    ap.add_argument("--spark-kafka-jars", required=True,
                    help="a folder with Spark's Kafka connector for this PySpark and what it needs (its jars)")
    ap.add_argument("--locks", default="2000,10000")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    args = parse_args(ap, argv)
    jars = sorted(glob.glob(os.path.join(os.path.expanduser(args.spark_kafka_jars), "*.jar")))
    if not any("spark-sql-kafka" in os.path.basename(j) for j in jars):
        ap.error(f"--spark-kafka-jars {args.spark_kafka_jars!r} holds no spark-sql-kafka-0-10 jar")
    spark = local_session(floor=True, jars=jars)
    tmp = tempfile.mkdtemp(prefix="bench-spark-kafka-")
    try:
        results = {"records": args.records, "partitions": args.partitions, "rounds": args.rounds,
                   "pyspark": pyspark.__version__, "jars": [os.path.basename(j) for j in jars],
                   "settings": [one_lock_setting(spark, args, n, tmp) for n in comma_ints(args.locks)]}
    finally:
        spark.stop()
    write_json(os.path.join(args.out, "results.json"), results)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
