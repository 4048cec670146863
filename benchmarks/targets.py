"""The speed targets on a real Kafka broker, side by side in one run: kafka-share, a raw share-consumer
loop, and Spark's floor (a Python source yielding prebuilt Arrow batches) at the same batch size.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python benchmarks/targets.py --kafka-start tests/harness/kafka_dist/start.sh [--rounds 2]
    .venv/bin/python benchmarks/targets.py --bootstrap-servers broker:9092 [--kafka-option K=V ...]

With ``--kafka-start`` it starts one broker per lock setting (``group.share.partition.max.record.locks``
2,000, Kafka's default, and 10,000), each removed after its runs; a cluster of yours keeps its own
setting (say it with ``--locks``). On each: one topic of ``--records`` records on ``--partitions``
partitions, read by a fresh share group per run (share heartbeat 1 s, set per group):

- throughput: the raw loop (2 consumers, from its process start); kafka-share with ``numPartitions``
  unset and with each of ``--slots``, from query start and after the first batch; Spark's floor with
  the default run's batches; CPU of our processes per million records above the floor's;
- the lock-budget bound: partitions x locks / the time a record is in flight (acquired -> confirmed
  acknowledged, measured per batch by the tracker), and where that time goes;
- start-up (first broker only): query start -> first rows against the group join (a share consumer's
  subscribe -> first records), with the group's heartbeat at 5 s (Kafka's default) and at 1 s;
- lock safety (last broker only): a 2 s group lock and a sink that stalls its first two batches past
  it: the batches that expired, the smaller batches after them, and how the size grows back (keep it
  on a big backlog: Kafka 4.2 hands records delivered repeatedly out one per fetch, and a backlog of
  only those drains at about two records a batch; docs/performance.md).

Prints the targets' table and writes results.json and targets.png (throughput against batch size,
with the bounds; bench_charts.py draws it) to ``--out``. Not part of the test run. It must never put
figures of two brokers (lock settings) in one ratio, nor leave anything behind: the brokers it starts
are removed, and on a cluster of yours the topics and groups it made are deleted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

from bench_charts import targets_chart
from bench_common import backlog, comma_ints, comma_set, local_session, med, parse_args, real_cluster, write_json
from bench_cpu import cpu_seconds
from bench_runs import first_rows, floor_run, raw_loop, share_run, warm_up

from harness.kafka_cluster import add_cluster_arguments

LOCKS_PROP = "group.share.partition.max.record.locks"
SHORT_LOCK_MS = 2000


def broker_cpu(kafka) -> float:
    """CPU seconds the brokers this run started have used so far (0 on a cluster of yours)."""
    return cpu_seconds(getattr(kafka, "broker_pids", []))


def full_batches(run: dict) -> list[dict]:
    """The tracker's summaries of a run's batches after the first, at least half the biggest."""
    rows = [b for b in run["tracked"][1:] if b.get("acquired")]
    top = max((b["acquired"] for b in rows), default=0)
    return [b for b in rows if b["acquired"] >= 0.5 * top and "phasesMs" in b]


def in_flight(run: dict, budget: int) -> dict:
    """Median time in flight of the run's full batches, its parts, and the bound it sets."""
    full = full_batches(run)
    if not full:
        return {}
    held = statistics.median(b["holdMs"] for b in full)
    parts = {k: statistics.median(b["phasesMs"][k] for b in full) for k in full[0]["phasesMs"]}
    return {"held_ms": held, "phases_ms": parts, "bound_rps": budget / (held / 1000.0),
            "expired": sum(b.get("expired", 0) for b in run["tracked"])}


def throughput(spark, kafka, args, locks: int, tmp: str, cores: int) -> dict:
    from spark_share.driver.policy import default_slots

    kafka.set_heartbeat_interval(1000)
    topic = backlog(kafka, args.partitions, args.records)
    raw_loop(kafka, topic, 2, args.records)  # not measured: the first group to read a new topic is slower
    budget = args.partitions * locks
    default = default_slots(args.partitions, str(cores))
    out = {"locks": locks, "budget": budget, "default_slots": default, "rounds": []}
    for rnd in range(args.rounds):
        runs, raw = {}, None
        # One after another on the same broker, in the reverse order every other round: the broker
        # (log segments, page cache) and the JVM warm up over a run.
        order = ["raw", None, *args.slots]
        for slots in order if rnd % 2 == 0 else order[::-1]:
            cpu0 = broker_cpu(kafka)
            if slots == "raw":
                raw = raw_loop(kafka, topic, 2, args.records)
                raw["broker_cpu_per_m"] = (broker_cpu(kafka) - cpu0) / args.records * 1e6
                continue
            run = share_run(spark, kafka, topic, slots, args.records, tmp)
            run["broker_cpu_per_m"] = (broker_cpu(kafka) - cpu0) / args.records * 1e6
            run.update(in_flight(run, budget))
            runs["default" if slots is None else str(slots)] = run
            print(f"locks {locks} round {rnd + 1} numPartitions={slots or f'unset ({default})'}: "
                  f"{args.records / run['seconds']:,.0f}/s from start, "
                  f"{run['steady_records'] / run['steady_seconds']:,.0f}/s after the first batch, mean batch "
                  f"{run['mean_batch']:,.0f}, in flight {run.get('held_ms', 0):.0f} ms {run.get('phases_ms')}",
                  flush=True)
        ours = runs["default"]
        steady = [b for b in ours["phases"][1:] if b["rows"]]
        floor = floor_run(spark, max(1, len(steady)), default,
                          max(1, int(statistics.mean(b["rows"] for b in steady) / default)) if steady else 1, tmp)
        out["rounds"].append({"raw": raw, "runs": runs, "floor": floor})
        print(f"locks {locks} round {rnd + 1}: raw loop {args.records / raw['process_seconds']:,.0f}/s from its "
              f"process start; Spark's floor {floor['steady_rps']:,.0f}/s after the first batch", flush=True)
    return out


def group_join_s(kafka, topic: str) -> float:
    """A fresh share consumer's subscribe -> its first records: what joining the group costs."""
    from confluent_kafka import ShareConsumer

    c = ShareConsumer({**kafka.client(), "group.id": kafka.group(f"join-{uuid.uuid4().hex[:6]}")})
    try:
        t0 = time.perf_counter()
        c.subscribe([topic])
        while time.perf_counter() - t0 < 60:
            if c.poll(0.1):
                return time.perf_counter() - t0
        raise RuntimeError("no record within 60 s of subscribing")
    finally:
        c.close()


def startup(spark, kafka, tmp: str, runs: int) -> dict:
    out = {}
    for heartbeat in (5000, 1000):
        kafka.set_heartbeat_interval(heartbeat)
        topic = backlog(kafka, 2, 100)
        joins = [group_join_s(kafka, topic) for _ in range(runs)]
        firsts = []
        for _ in range(runs):
            first, _end = first_rows(spark, kafka, topic, tmp)
            if first is None:
                raise RuntimeError("no rows within 300 s of the query's start")
            firsts.append(first)
        out[str(heartbeat)] = {"join_s": joins, "first_rows_s": firsts}
        print(f"start-up, heartbeat {heartbeat} ms: group join {[round(x, 2) for x in joins]} s, query start -> "
              f"first rows {[round(x, 2) for x in firsts]} s", flush=True)
    return out


def short_lock(spark, kafka, args, tmp: str) -> dict:
    """A 2 s group lock; the sink stalls its first two batches with rows for 1.5 locks."""
    kafka.set_heartbeat_interval(1000)
    kafka.set_record_lock_duration(SHORT_LOCK_MS)
    topic = backlog(kafka, args.partitions, args.records)
    stalls = []

    def sink(df, _batch_id):
        if df.count() and len(stalls) < 2:
            stalls.append(1)
            time.sleep(1.5 * SHORT_LOCK_MS / 1000.0)

    run = share_run(spark, kafka, topic, None, args.records, tmp, sink=sink)
    series = [{"batch": b["batch"], "rows": b["acquired"], "held_ms": b.get("holdMs"), "expired": b.get("expired", 0)}
              for b in run["tracked"] if b.get("acquired")]
    print("short lock:", json.dumps(series), flush=True)
    return {"lock_ms": SHORT_LOCK_MS, "records": run["records"], "series": series}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_arguments(ap)
    ap.add_argument("--locks", default="2000,10000",
                    help="record locks per partition: the brokers to start, or what your cluster has (one value)")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--slots", default="2,8", help="numPartitions settings run beside the default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--startup-runs", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated: startup,shortlock")
    ap.add_argument("--out", default="bench-out")
    args = parse_args(ap, argv)
    args.slots = comma_ints(args.slots)
    lock_settings = comma_ints(args.locks)
    if args.bootstrap_servers and len(lock_settings) != 1:
        ap.error("with --bootstrap-servers, --locks is the one value your cluster has")
    skip = comma_set(args.skip)
    spark = local_session(floor=True)
    cores = spark.sparkContext.defaultParallelism
    tmp = tempfile.mkdtemp(prefix="bench-targets-")
    results = {"records": args.records, "partitions": args.partitions, "cores": cores, "settings": []}
    try:
        for i, locks in enumerate(lock_settings):
            with real_cluster(args, {LOCKS_PROP: str(locks)}, "spark-share-targets") as kafka:
                if i == 0:  # warm-up, not measured: JIT, Spark's Python planning workers
                    warm_up(spark, kafka, 2, tmp)
                    if "startup" not in skip:
                        results["startup"] = startup(spark, kafka, tmp, args.startup_runs)
                results["settings"].append(throughput(spark, kafka, args, locks, tmp, cores))
                if i == len(lock_settings) - 1 and "shortlock" not in skip:
                    results["short_lock"] = short_lock(spark, kafka, args, tmp)
    finally:
        spark.stop()
    for s in results["settings"]:  # the per-batch summaries are kept as numbers above; the file stays small
        for r in s["rounds"]:
            for run in r["runs"].values():
                run.pop("tracked", None)
    write_json(os.path.join(args.out, "results.json"), results)
    report(results)
    targets_chart(results, args.out)
    return 0


def _spark_phase(phases: list[dict], key: str) -> float:
    """Median of one of Spark's durations over a run's full batches after the first."""
    rows = [p for p in phases[1:] if p["rows"]]
    top = max((p["rows"] for p in rows), default=0)
    return med(p.get(key) for p in rows if p["rows"] >= 0.5 * top)


def report(results: dict) -> None:
    n = results["records"]
    print("\n| target | setting | kafka-share | compared with | ratio | goal |")
    print("|---|---|---|---|---|---|")
    for s in results["settings"]:
        rounds, lk = s["rounds"], f"{s['locks']:,} locks"

        def run(key, field):
            return med(r["runs"][key].get(field) for r in rounds if key in r["runs"])

        def steady(key):
            return med(r["runs"][key]["steady_records"] / r["runs"][key]["steady_seconds"] for r in rounds)

        ours_steady, floor = steady("default"), med(r["floor"]["steady_rps"] for r in rounds)
        bound, held = run("default", "bound_rps"), run("default", "held_ms")
        print(f"| 1. after the first batch vs Spark's floor at the same batch size | {lk}, mean batch "
              f"{run('default', 'mean_batch'):,.0f} | {ours_steady:,.0f}/s | {floor:,.0f}/s | "
              f"{ours_steady / floor:.2f} | >= 0.9 |")
        print(f"| (bound) lock budget {s['budget']:,} / {held:.0f} ms in flight | {lk} | {ours_steady:,.0f}/s | "
              f"{bound:,.0f}/s | {ours_steady / bound:.2f} | |")
        phases = {k: med(r["runs"]["default"].get("phases_ms", {}).get(k) for r in rounds)
                  for k in ("poll", "toRead", "convert", "spark", "ack")}
        print(f"| (in flight, ms) | {lk} | to the read task {phases['toRead']:.0f} (converting "
              f"{phases['convert']:.0f}), Spark's batch to its commit {phases['spark']:.0f}, acknowledgement "
              f"{phases['ack']:.0f}; before it, the poll {phases['poll']:.0f} | | | |")
        raw = med(n / r["raw"]["process_seconds"] for r in rounds)
        start = med(n / r["runs"]["default"]["seconds"] for r in rounds)
        goal = ">= 0.35" if s["locks"] >= 10_000 else ">= 0.25"
        print(f"| 2. from query start vs the raw loop from its process start | {lk} | {start:,.0f}/s | {raw:,.0f}/s | "
              f"{start / raw:.2f} | {goal} |")
        print(f"| (context) Spark's floor at these batches (after its first) vs the raw loop: what any source that "
              f"holds a batch's records until Spark commits could reach | {lk} | {floor:,.0f}/s | {raw:,.0f}/s | "
              f"{floor / raw:.2f} | |")
        sp = {k: (med(_spark_phase(r["runs"]["default"]["phases"], k) for r in rounds),
                  med(_spark_phase(r["floor"]["phases"], k) for r in rounds))
              for k in ("latestOffset", "walCommit", "queryPlanning", "addBatch", "commitOffsets", "triggerExecution")}
        print(f"| (Spark's batch phases, ms, ours / the floor's) | {lk} | "
              + ", ".join(f"{k} {a:.0f} / {b:.0f}" for k, (a, b) in sp.items()) + " | | | |")
        bc, rbc = med(r["runs"]["default"]["broker_cpu_per_m"] for r in rounds), med(r["raw"]["broker_cpu_per_m"] for r in rounds)
        print(f"| (context) the broker's own CPU-s per million records, on the same 2 cores (the floor has no broker) "
              f"| {lk} | {bc:.2f} | {rbc:.2f} (raw loop) | | |")
        for key in rounds[0]["runs"]:
            if key != "default":
                other = med(n / r["runs"][key]["seconds"] for r in rounds)
                print(f"| 3. numPartitions unset ({s['default_slots']}) vs numPartitions={key}, from query start | {lk} "
                      f"| {start:,.0f}/s | {other:,.0f}/s | {start / other:.2f} | >= 1.0 (within the spread) |")
        ours_cpu = med(r["runs"]["default"]["steady_cpu"] / r["runs"]["default"]["steady_records"] * 1e6 for r in rounds)
        floor_cpu = med(r["floor"]["steady_cpu_per_m"] for r in rounds)
        raw_cpu = med(r["raw"]["cpu"] / r["raw"]["records"] * 1e6 for r in rounds)
        print(f"| 5. CPU-s per million above Spark's floor vs the raw loop's | {lk} | {ours_cpu - floor_cpu:.2f} "
              f"({ours_cpu:.2f} - floor {floor_cpu:.2f}) | {raw_cpu:.2f} | {(ours_cpu - floor_cpu) / raw_cpu:.2f} | <= 1.0 |")
        expired = sum(r["runs"][k].get("expired", 0) for r in rounds for k in r["runs"])
        print(f"| 6. records whose lock expired, 30 s lock | {lk} | {expired} | | | 0 |")
    st = results.get("startup")
    for hb, v in (st or {}).items():
        join, first = med(v["join_s"]), med(v["first_rows_s"])
        print(f"| 4. query start -> first rows vs the group join + 2 s | heartbeat {int(hb) // 1000} s | {first:.1f} s | "
              f"{join:.1f} + 2 s | {first / (join + 2):.2f} | <= 1.0 |")
    sl = results.get("short_lock")
    if sl:
        s = sl["series"]
        expired = [b for b in s if b["expired"]]
        after = s[s.index(expired[-1]) + 1:] if expired else s
        steps = []  # batch sizes as they grow back: each new size at least 1.5 times the last
        for b in after:
            if not steps or b["rows"] >= 1.5 * steps[-1][1]:
                steps.append((b["batch"], b["rows"]))
        print(f"| 6. a {sl['lock_ms'] // 1000} s group lock, the sink stalled 1.5 locks in its first two batches | "
              f"{len(s)} batches | expired: " + ", ".join(f"{b['expired']:,} (batch {b['batch']})" for b in expired)
              + f"; after them {sum(b['expired'] for b in after)} | batch sizes after the expiry, as they grow back: "
              + ", ".join(f"{rows:,} (batch {batch})" for batch, rows in steps)
              + f" | read {sl['records']:,} of {n:,} (the expired ones again) | no expiry after the shrink; grows back |")


if __name__ == "__main__":
    sys.exit(main())
