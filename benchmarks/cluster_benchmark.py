"""The benchmark's cluster mode: kafka-share on a Spark standalone cluster of 2 and 3 worker hosts
(network namespaces on this machine: tests/harness/spark_hosts.py), next to a raw share-consumer loop with one
consumer on each of the same hosts, on one embedded broker.

    .venv/bin/python benchmarks/cluster_benchmark.py [--hosts 2,3] [--records 60000] [--partitions 12]

Needs root and socat, as the cluster tests. Prints a table and writes results.json to --out. Every
"host" shares this machine's 2 cores, and one embedded broker (one thread) serves them all: the
figures say what the multi-host path costs next to the raw loop, not how a real cluster scales.
Not part of the test run.

The same file is the driver program (``driver``) and the raw loop (``raw``) that run on the hosts. The
driver role is the user's program on the driver host: it must never import the benchmarks' helpers or
measure anything there beyond its own query's progress (the helpers are imported where they are used,
on this side only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def driver(args) -> int:
    """On the driver host: AvailableNow over the backlog into the noop sink, one slot per host."""
    from pyspark.sql import SparkSession

    import spark_share

    spark = (SparkSession.builder.master(args.master).appName("spark-share-cluster-bench")
             .config("spark.driver.host", args.driver_host).config("spark.driver.bindAddress", args.driver_host)
             .config("spark.executor.cores", "1").config("spark.executor.memory", "640m")
             .config("spark.cores.max", str(args.slots)).config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    spark_share.register(spark)
    # Warm-up, not measured: executors start, Python workers import pyspark.
    spark.range(0, 1000, numPartitions=args.slots).rdd.map(lambda x: x).count()
    t0 = time.time()
    q = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", args.bootstrap)
         .option("kafka.group.id", args.group).option("subscribe", args.topic)
         .option("readMode", "executors")  # the agents on each worker host are what it measures
         .option("numPartitions", str(args.slots)).load()
         .writeStream.format("noop").option("checkpointLocation", os.path.join(args.out, f"ck-{uuid.uuid4().hex}"))
         .trigger(availableNow=True).start())
    q.awaitTermination(900)
    end = time.time()
    prog = [json.loads(p.json) for p in q.recentProgress]
    error = str(q.exception())[:2000] if q.exception() else None
    spark.stop()
    print("RESULT", json.dumps({"start": t0, "end": end, "progress": prog, "error": error}), flush=True)
    return 0


RAW = r"""
import json, sys, time
from confluent_kafka import ShareConsumer, AcknowledgeType
cfg = json.loads(sys.argv[1])
c = ShareConsumer({"bootstrap.servers": cfg["bootstrap"], "group.id": cfg["group"],
                   "share.acknowledgement.mode": "explicit", "max.poll.records": "10000"})
c.subscribe([cfg["topic"]])
got, first, last, idle_since = 0, None, None, None
start = time.time()
while True:
    msgs = c.poll(0.2)
    ok = [m for m in msgs if m.error() is None]
    for m in ok:
        c.acknowledge(m, AcknowledgeType.ACCEPT)
    if ok:
        got += len(ok)
        first = first or time.time()
        last, idle_since = time.time(), None
    elif got:
        idle_since = idle_since or time.time()
        if time.time() - idle_since > 3:  # the backlog is drained (another host may still hold its share)
            break
    elif time.time() - start > 60:
        break
c.commit_sync(30)
c.close()
print("RESULT", json.dumps({"start": start, "first": first, "last": last, "records": got}), flush=True)
"""


def _result(proc, timeout: float) -> dict:
    proc.wait(timeout)
    text = open(proc.log_path, errors="replace").read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no result from {proc.args[-1][:80]}: {text[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _steady(progress: list[dict]) -> tuple[int, float]:
    """(records, seconds) after the first batch with rows, from the progress events' own clocks."""
    from bench_runs import batch_end

    full = [p for p in progress if p["numInputRows"]]
    if len(full) < 2:
        return 0, 0.0
    return sum(p["numInputRows"] for p in full[1:]), batch_end(full[-1]) - batch_end(full[0])


def measure(hosts: int, args) -> dict:
    from bench_common import produce, rounded

    from harness.spark_hosts import NamespaceCluster
    from spark_share.embedded import EmbeddedKafka

    row: dict = {"hosts": hosts}
    with EmbeddedKafka() as kafka:
        c = NamespaceCluster(workers=hosts, cores=1, memory="1g")
        try:
            c.start()
            c.forward(kafka.bootstrap_servers)
            for name in ("raw", "share"):
                produce({"bootstrap.servers": kafka.bootstrap_servers}, kafka.create_topic(name, args.partitions),
                        args.records, args.partitions)
            env = {"PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), "PYSPARK_PYTHON": sys.executable}  # the source runner imports pyarrow
            cfg = {"bootstrap": kafka.bootstrap_servers, "group": f"raw-{uuid.uuid4().hex[:6]}", "topic": "raw"}
            raws = [c.spawn(f"w{i}", [sys.executable, "-c", RAW, json.dumps(cfg)], env=env, log_name=f"raw-w{i}.log")
                    for i in range(1, hosts + 1)]
            outs = [_result(r, 600) for r in raws]
            got = sum(o["records"] for o in outs)
            firsts = [o["first"] for o in outs if o["first"]]
            span = max(o["last"] for o in outs if o["last"]) - min(firsts)
            row.update(raw_records=got, raw_rps=got / span, raw_per_host=[o["records"] for o in outs])
            app = c.spawn("driver", [sys.executable, os.path.abspath(__file__), "driver", "--master", c.master_url,
                                     "--driver-host", c.hosts["driver"], "--bootstrap", kafka.bootstrap_servers,
                                     "--topic", "share", "--group", f"share-{uuid.uuid4().hex[:6]}",
                                     "--slots", str(hosts), "--out", c.shared],
                          env=env, log_name="driver.log")
            res = _result(app, 900)
            if res["error"]:
                raise RuntimeError(res["error"])
            rows = sum(p["numInputRows"] for p in res["progress"])
            steady_rows, steady_s = _steady(res["progress"])
            row.update(share_records=rows, share_rps=rows / (res["end"] - res["start"]),
                       share_steady_rps=steady_rows / steady_s if steady_s else None,
                       batches=len([p for p in res["progress"] if p["numInputRows"]]))
        finally:
            c.stop()
    print("hosts", json.dumps(rounded(row, 1)), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role")
    d = sub.add_parser("driver")
    for a in ("--master", "--driver-host", "--bootstrap", "--topic", "--group", "--out"):
        d.add_argument(a, required=True)
    d.add_argument("--slots", type=int, required=True)
    ap.add_argument("--hosts", default="2,3", help="worker host counts to measure, comma-separated")
    ap.add_argument("--records", type=int, default=60_000)
    ap.add_argument("--partitions", type=int, default=12, help="a multiple of every host count: equal shares")
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args(argv)
    if args.role == "driver":
        return driver(args)
    os.makedirs(args.out, exist_ok=True)
    rows = [measure(int(h), args) for h in args.hosts.split(",")]
    from bench_common import write_json

    write_json(os.path.join(args.out, "cluster-results.json"),
               {"records": args.records, "partitions": args.partitions, "rows": rows}, indent=2)
    print("\n| worker hosts | kafka-share, records/s (from query start) | kafka-share, after the first batch | "
          "raw loop, one consumer per host | ratio (after the first batch) |")
    print("|---|---|---|---|---|")
    for r in rows:
        steady = r["share_steady_rps"]
        print(f"| {r['hosts']} | {r['share_rps']:,.0f} | {steady:,.0f} | {r['raw_rps']:,.0f} | "
              f"{steady / r['raw_rps']:.2f} |" if steady else f"| {r['hosts']} | {r['share_rps']:,.0f} | - | "
              f"{r['raw_rps']:,.0f} | - |")
    print(f"\n{args.records:,} records of 100 bytes on {args.partitions} partitions; one run per host count "
          "(repeat the command to see the spread)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
