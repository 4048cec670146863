"""kafka-share beside Spark's own Kafka source (``format("kafka")``) and beside the lock-budget bound, side
by side in one run on a real Kafka, per record-lock setting and value size.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python benchmarks/spark_kafka.py \\
        --kafka-start tests/harness/kafka_dist/start.sh --spark-kafka-jars ~/spark-kafka-jars \\
        [--locks 2000,10000] [--value-bytes 100,1000,10000] [--locks-on broker|group] [--rounds 3] [--out DIR]

``--spark-kafka-jars``: a folder with Spark's Kafka connector for the installed PySpark
(spark-sql-kafka-0-10, spark-token-provider-kafka-0-10, kafka-clients, commons-pool2: what
``--packages org.apache.spark:spark-sql-kafka-0-10_2.13:<version>`` would fetch); spark-share ships none.

One broker per lock setting, removed after its runs: with ``--locks-on broker`` the setting is the broker's
``group.share.partition.max.record.locks`` (every Kafka >= 4.2); with ``--locks-on group`` (Kafka >= 4.3,
KIP-1240) the broker keeps Kafka's default and its upper bound is raised to the setting, and each share group
gets it as its own ``share.partition.max.record.locks``. Per value size, one topic of ``--records`` x 100 B
of data (``--records`` records of 100 bytes; at bigger values as many bytes, at least three budgets) on
``--partitions`` partitions (a setting whose full batch passes 200 MB is left out); one Spark session
(``local[2]``). Each round, in the reverse order every other
round: Spark's source reading the topic from its earliest offsets, and kafka-share (its defaults:
``readMode=driver``, a fresh share group at Kafka's default heartbeat), each ``Trigger.AvailableNow`` into
the noop sink; then Spark's floor (a Python source that yields prebuilt rows, bench_floor.py) with
kafka-share's batches, tasks and rows.

The bound: a batch holds its records until Spark commits it, so kafka-share reads at most partitions x
locks records per batch time; at Spark's floor batch time (the floor's median batch, same shape) that is
the bound its after-the-first-batch rate is set against. Where a record's lock goes: the tracker's
``phasesMs`` (medians of the full batches after the first). The first rows: the query's start to the end
of its first batch with rows, against the group's heartbeat (5 s, Kafka's default) + 1 s. CPU: seconds per
million records, query start to end, of the Spark side (Spark's JVM, and kafka-share's runner and Python
workers) and of the broker, each side's run alone.

Prints the targets with whether each was met, writes results.json and table.md (the table of
docs/performance.md, one row per lock setting and value size) to ``--out``. Not part of the test run; it
must never put figures of two brokers in one ratio.
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
from bench_cpu import CpuSampler, cpu_seconds, side_cpu_per_m
from bench_runs import available_now, batch_end, floor_beside, share_run
from targets import LOCKS_PROP, in_flight

from harness.kafka_cluster import add_cluster_arguments

HEARTBEAT_S = 5.0  # Kafka's group.share.heartbeat.interval.ms: the group join of a query's first batch
# The targets, as ratios: after the first batch / the bound; from start / Spark's source, per locks; and
# MB/s after the first batch at 1 KB values, past what one driver core carries (3 times about 50 MB/s).
AFTER_FIRST_OF_BOUND = 0.85
FROM_START_OF_SPARK = {2000: 0.5, 10000: 0.8}
AFTER_FIRST_MBPS_AT_1KB = 150.0
KAFKA_DEFAULT_LOCKS = 2000
MAX_LOCKS_PROP = "group.share.max.partition.max.record.locks"  # the brokers' bound on a group's own setting
# The Spark side's processes (bench_cpu's kinds): Spark's JVM; kafka-share's source runner and Python workers.
JVM, RUNNER, WORKERS = "JVM (Spark driver and executor)", "runner", "python workers"
SPARK_SIDE = (JVM, RUNNER, WORKERS, "agent")
# A full batch (budget x value size) above this is not run: its rows pass through a local[2] driver's 1 GB
# heap as task payloads (readMode=driver), and Spark's source reads the backlog as one batch.
MAX_BATCH_BYTES = 200 << 20


def records_for(args, value_bytes: int, budget: int) -> int:
    """As many bytes as ``--records`` records of 100 B, and at least three lock budgets' worth of records
    (a first batch and full ones after it)."""
    return max(args.records * 100 // value_bytes, 3 * budget)


def broker_cpu(kafka) -> float | None:
    pids = getattr(kafka, "broker_pids", None)
    return cpu_seconds(pids) if pids else None


def per_m(seconds: float | None, n: int) -> float | None:
    return None if seconds is None else seconds / n * 1e6


def spark_kafka_run(spark, kafka, topic: str, n: int, tmp: str) -> dict:
    """Spark's own source over ``topic`` from its earliest offsets, AvailableNow into the noop sink."""
    r = spark.readStream.format("kafka").option("subscribe", topic).option("startingOffsets", "earliest")
    for k, v in kafka.client().items():
        r = r.option("kafka." + k, v)
    broker0 = broker_cpu(kafka)
    with CpuSampler() as cpu:
        t0, wall0 = time.perf_counter(), time.time()
        q = available_now(r.load().writeStream.format("noop"), tmp)
        q.awaitTermination()
        seconds = time.perf_counter() - t0
    broker1 = broker_cpu(kafka)
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    rows = sum(p["numInputRows"] for p in prog)
    if q.exception() is not None or rows < n:
        raise RuntimeError(f"Spark's Kafka source read {rows:,} of {n:,} records (query exception: {q.exception()})")
    return {"seconds": seconds, "rps": n / seconds, "batches": len(prog),
            "first_row_s": batch_end(prog[0]) - wall0 if prog else None,
            "cpu_per_m": side_cpu_per_m(cpu.by_kind, SPARK_SIDE, n),
            "broker_cpu_per_m": per_m(None if broker0 is None else broker1 - broker0, n)}


def kafka_share_run(spark, kafka, topic: str, n: int, budget: int, tmp: str) -> dict:
    """kafka-share at its defaults over ``topic``: its rates, the time a record's lock took, its CPU."""
    broker0 = broker_cpu(kafka)
    run = share_run(spark, kafka, topic, None, n, tmp, readMode="driver")
    broker1 = broker_cpu(kafka)
    run.update(in_flight(run, budget))
    steady = run["steady_records"] / run["steady_seconds"] if run["steady_records"] else None
    return {k: run[k] for k in ("seconds", "batches", "mean_batch", "first_row_s", "phases")} | {
        "rps": n / run["seconds"], "after_first": steady, "held_ms": run.get("held_ms"),
        "phases_ms": run.get("phases_ms"), "expired": run.get("expired"),
        "cpu_per_m": side_cpu_per_m(run["cpu_by_process"], SPARK_SIDE, n),
        "cpu_per_m_by_process": {k: v / n * 1e6 for k, v in run["cpu_by_process"].items() if k in SPARK_SIDE},
        "steady_cpu_per_m_by_process": {k: v for k, v in run["steady_cpu_per_m_by_process"].items() if k in SPARK_SIDE},
        "broker_cpu_per_m": per_m(None if broker0 is None else broker1 - broker0, n)}


def floor_batch_ms(floor: dict) -> float:
    """Spark's floor: the median time of its batches with rows after the first."""
    return statistics.median(p["triggerExecution"] for p in floor["phases"][1:] if p["rows"])


def broker_props(args, locks: int) -> dict[str, str]:
    if args.locks_on == "group":  # Kafka's default for every group, and room for this group's own setting
        return {LOCKS_PROP: str(KAFKA_DEFAULT_LOCKS), MAX_LOCKS_PROP: str(max(locks, KAFKA_DEFAULT_LOCKS))}
    return {LOCKS_PROP: str(locks)}


def one_lock_setting(spark, args, locks: int, tmp: str) -> list[dict]:
    from spark_share.driver.policy import default_slots

    budget = args.partitions * locks
    slots = default_slots(args.partitions, "2")
    out: list[dict] = []
    with real_cluster(args, broker_props(args, locks), "spark-share-spark-kafka") as kafka:
        if args.locks_on == "group":
            kafka.set_record_locks(locks)  # every group this run declares, before any of them reads
        for value_bytes in comma_ints(args.value_bytes):
            if budget * value_bytes > MAX_BATCH_BYTES:
                print(f"locks {locks}, {value_bytes} B: not run (a full batch is {budget * value_bytes >> 20} MB, "
                      f"above {MAX_BATCH_BYTES >> 20} MB)", flush=True)
                continue
            n = records_for(args, value_bytes, budget)
            setting: dict = {"locks": locks, "locks_on": args.locks_on, "budget": budget, "value_bytes": value_bytes,
                             "records": n, "rounds": []}
            topic = backlog(kafka, args.partitions, n, value_bytes)
            # Not measured: the topic's first readers (the broker's page cache, the JVM's and workers' start).
            spark_kafka_run(spark, kafka, topic, n, tmp)
            kafka_share_run(spark, kafka, topic, n, budget, tmp)
            for rnd in range(args.rounds):
                got: dict = {}
                for name in ("spark", "share") if rnd % 2 == 0 else ("share", "spark"):
                    got[name] = (spark_kafka_run(spark, kafka, topic, n, tmp) if name == "spark"
                                 else kafka_share_run(spark, kafka, topic, n, budget, tmp))
                floor = floor_beside(spark, got["share"], slots, n, tmp, value_bytes)
                got["floor_batch_ms"] = floor_batch_ms(floor)
                got["bound_rps"] = budget / (got["floor_batch_ms"] / 1000.0)
                setting["rounds"].append(got)
                s, k = got["spark"], got["share"]
                after = f"{k['after_first']:,.0f}/s" if k["after_first"] else "-"
                print(f"locks {locks} ({args.locks_on}), {value_bytes} B, round {rnd + 1}: Spark's source "
                      f"{s['rps']:,.0f}/s ({s['batches']} batches, {s['cpu_per_m']:.1f} CPU-s/M); kafka-share "
                      f"{k['rps']:,.0f}/s from start, {after} after the first batch ({k['batches']} batches of "
                      f"{k['mean_batch']:,.0f}), first rows {k['first_row_s']:.1f} s, {k['cpu_per_m']:.1f} CPU-s/M; "
                      f"floor batch {got['floor_batch_ms']:.0f} ms, bound {got['bound_rps']:,.0f}/s; "
                      f"lock held {k['held_ms'] or 0:.0f} ms {k['phases_ms']}", flush=True)
            out.append(setting)
    return out


def _med(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return med(xs) if xs else None


def summary(s: dict) -> dict:
    """One setting's medians over its rounds."""
    rs = s["rounds"]
    mb = s["value_bytes"] / 1e6
    row = {"locks": s["locks"], "locks_on": s["locks_on"], "value_bytes": s["value_bytes"], "records": s["records"],
           "budget": s["budget"],
           "spark_rps": med(r["spark"]["rps"] for r in rs), "share_rps": med(r["share"]["rps"] for r in rs),
           "after_first": _med(r["share"]["after_first"] for r in rs), "bound_rps": med(r["bound_rps"] for r in rs),
           "floor_batch_ms": med(r["floor_batch_ms"] for r in rs), "first_row_s": med(r["share"]["first_row_s"] for r in rs),
           "spark_cpu_per_m": med(r["spark"]["cpu_per_m"] for r in rs),
           "share_cpu_per_m": med(r["share"]["cpu_per_m"] for r in rs),
           "spark_broker_cpu_per_m": _med(r["spark"]["broker_cpu_per_m"] for r in rs),
           "share_broker_cpu_per_m": _med(r["share"]["broker_cpu_per_m"] for r in rs),
           "held_ms": _med(r["share"]["held_ms"] for r in rs),
           # After the first batch, per process: what readMode=driver puts on the driver host (the runner) and
           # on the executors (Python workers), beside Spark's JVM (both, in local mode).
           "steady_cpu_per_m": {kind: _med(r["share"].get("steady_cpu_per_m_by_process", {}).get(kind) for r in rs)
                                for kind in (RUNNER, WORKERS, JVM)},
           "phases_ms": {k: round(med(r["share"]["phases_ms"][k] for r in rs if r["share"]["phases_ms"]))
                         for k in (rs[0]["share"]["phases_ms"] or {})}}
    row["of_spark"] = row["share_rps"] / row["spark_rps"]
    row["of_bound"] = row["after_first"] / row["bound_rps"] if row["after_first"] else None
    row["spark_mbps"], row["share_mbps"] = row["spark_rps"] * mb, row["share_rps"] * mb
    row["after_first_mbps"] = row["after_first"] * mb if row["after_first"] else None
    runner = row["steady_cpu_per_m"][RUNNER]
    row["driver_core_mbps"] = s["value_bytes"] / runner if runner else None  # MB/s of records one core of it carries
    return row


def _n(x, fmt=",.0f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


def table(rows: list[dict]) -> str:
    """The markdown table of docs/performance.md: one row per lock setting and value size."""
    lines = ["| record locks | value | Spark's `format(\"kafka\")` | kafka-share from start | ratio | kafka-share after "
             "the first batch | the bound (floor batch) | of the bound | first rows | CPU-s per million: Spark's / "
             "kafka-share (broker: Spark's / kafka-share's) | kafka-share after the first batch, CPU-s per million: "
             "driver process / Python workers / Spark's JVM (one driver core carries) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = "group" if r["locks_on"] == "group" else "broker"
        lines.append(
            f"| {r['locks']:,} ({where}) | {r['value_bytes']:,} B | {_n(r['spark_rps'])}/s, {_n(r['spark_mbps'], '.0f')} MB/s "
            f"| {_n(r['share_rps'])}/s, {_n(r['share_mbps'], '.0f')} MB/s | {r['of_spark']:.2f} "
            f"| {_n(r['after_first'])}/s, {_n(r['after_first_mbps'], '.0f')} MB/s "
            f"| {_n(r['bound_rps'])}/s ({r['floor_batch_ms']:.0f} ms) | {_n(r['of_bound'], '.2f')} | {r['first_row_s']:.1f} s "
            f"| {r['spark_cpu_per_m']:.1f} / {r['share_cpu_per_m']:.1f} ({_n(r['spark_broker_cpu_per_m'], '.1f')} / "
            f"{_n(r['share_broker_cpu_per_m'], '.1f')}) | {_by_process(r)} |")
    return "\n".join(lines) + "\n"


def _by_process(r: dict) -> str:
    cpu = r.get("steady_cpu_per_m") or {}
    if cpu.get(RUNNER) is None:  # results of a run before this column
        return "-"
    return (f"{_n(cpu[RUNNER], '.1f')} / {_n(cpu[WORKERS], '.1f')} / {_n(cpu[JVM], '.1f')} "
            f"({_n(r['driver_core_mbps'], '.0f')} MB/s)")


def report(results: dict) -> list[dict]:
    rows = [summary(s) for s in results["settings"]]
    print(f"\n{results['partitions']} partitions; medians of {results['rounds']} rounds; PySpark {results['pyspark']}")
    checks = []
    for r in rows:
        what = f"{r['locks']:,} locks ({r['locks_on']}), {r['value_bytes']:,} B"
        checks.append((f"{what}: from start, kafka-share / Spark's source",
                       f"{r['share_rps']:,.0f} / {r['spark_rps']:,.0f}", r["of_spark"],
                       FROM_START_OF_SPARK.get(r["locks"]) if r["value_bytes"] == 100 else None, ">="))
        if r["of_bound"] is not None:
            checks.append((f"{what}: after the first batch / the bound ({r['budget']:,} locks / floor batch "
                           f"{r['floor_batch_ms']:.0f} ms)", f"{r['after_first']:,.0f} / {r['bound_rps']:,.0f}",
                           r["of_bound"], AFTER_FIRST_OF_BOUND if r["locks"] == KAFKA_DEFAULT_LOCKS else None, ">="))
        if r["value_bytes"] == 1000 and r["after_first_mbps"]:
            checks.append((f"{what}: after the first batch, MB/s / {AFTER_FIRST_MBPS_AT_1KB:.0f}",
                           f"{r['after_first_mbps']:.0f} / {AFTER_FIRST_MBPS_AT_1KB:.0f}",
                           r["after_first_mbps"] / AFTER_FIRST_MBPS_AT_1KB, 1.0, ">="))
        checks.append((f"{what}: first rows, s / heartbeat + 1 s", f"{r['first_row_s']:.1f} / {HEARTBEAT_S + 1:.0f}",
                       r["first_row_s"] / (HEARTBEAT_S + 1), 1.0, "<="))
        print(f"{what}: a record's lock, median ms of the full batches: held {_n(r['held_ms'])}, {r['phases_ms']}; "
              f"CPU-s per million, Spark's source {r['spark_cpu_per_m']:.1f}, kafka-share {r['share_cpu_per_m']:.1f}; "
              f"after the first batch, kafka-share's driver process / Python workers / Spark's JVM: {_by_process(r)}")
    print(f"\n{'target':<100} | {'figures':>19} | ratio | goal    | met")
    for what, figures, ratio, goal, how in checks:
        met = "" if goal is None else ("yes" if (ratio >= goal if how == ">=" else ratio <= goal) else "no")
        print(f"{what:<100} | {figures:>19} | {ratio:5.2f} | {how + ' ' + str(goal) if goal else '-':<7} | {met}")
    return rows


def main(argv=None) -> int:
    import pyspark

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_arguments(ap)
    ap.add_argument("--spark-kafka-jars", required=True,
                    help="a folder with Spark's Kafka connector for this PySpark and what it needs (its jars)")
    ap.add_argument("--locks", default="2000,10000")
    ap.add_argument("--locks-on", choices=("broker", "group"), default="broker",
                    help="where the lock setting goes: the broker's default (Kafka >= 4.2), or each share group's "
                         "own share.partition.max.record.locks (Kafka >= 4.3)")
    ap.add_argument("--value-bytes", default="100")
    ap.add_argument("--records", type=int, default=1_000_000, help="records of 100 B (at bigger values: as many bytes)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    args = parse_args(ap, argv)
    if args.locks_on == "group" and args.bootstrap_servers:
        ap.error("--locks-on group starts its own brokers (--kafka-start): on a cluster of yours, set the groups' "
                 "share.partition.max.record.locks yourself and pass --locks with it")
    jars = sorted(glob.glob(os.path.join(os.path.expanduser(args.spark_kafka_jars), "*.jar")))
    if not any("spark-sql-kafka" in os.path.basename(j) for j in jars):
        ap.error(f"--spark-kafka-jars {args.spark_kafka_jars!r} holds no spark-sql-kafka-0-10 jar")
    spark = local_session(floor=True, jars=jars)
    tmp = tempfile.mkdtemp(prefix="bench-spark-kafka-")
    results: dict = {"partitions": args.partitions, "rounds": args.rounds, "pyspark": pyspark.__version__,
                     "jars": [os.path.basename(j) for j in jars], "settings": []}
    try:
        for n in comma_ints(args.locks):
            results["settings"] += one_lock_setting(spark, args, n, tmp)
            write_json(os.path.join(args.out, "results.json"), results)  # what a later setting's failure leaves
    finally:
        spark.stop()
    rows = report(results)
    results["summary"] = rows
    write_json(os.path.join(args.out, "results.json"), results)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table(rows))
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
