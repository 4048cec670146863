"""What Spark's JVM keeps open per query run, for a streaming source that is not ours.

    .venv/bin/python benchmarks/spark_run_cost.py [floor|rate|kafka-share] [--runs 9]

Starts and stops a foreachBatch query on the given source ``--runs`` times in one Spark session
and prints the JVM's open descriptors by kind after each run. ``floor`` is a Python streaming data
source that does no work (benchmarks/bench_floor.py), ``rate`` Spark's own; ``kafka-share`` reads a topic
of the embedded broker. The chaos verdict (tests/harness/resources.py, PER_QUERY_RUN) takes what the floor
source keeps per run off the JVM's counts. It must never count the first run (the JVM opens what it keeps
for the session then), only the growth per run after it.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile

from bench_common import local_session


def jvm_fds(pid: int) -> dict[str, int]:
    kinds: collections.Counter = collections.Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        kinds["file" if target.startswith("/") else target.split(":")[0]] += 1
    return dict(kinds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", choices=["floor", "rate", "kafka-share"])
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args(argv)
    import psutil

    from spark_share.embedded import EmbeddedKafka

    spark = local_session(floor=True)
    jvm = next(p for p in psutil.Process().children(recursive=True) if "java" in p.name())
    ckpt = tempfile.mkdtemp(prefix="spark-run-cost-")
    with EmbeddedKafka() as kafka:
        kafka.create_topic("t", 2)
        counts = []
        for run in range(args.runs):
            if args.source == "floor":
                r = spark.readStream.format("spark-share-floor").options(batches=10_000, tasks=2, rows=10)
            elif args.source == "rate":
                r = spark.readStream.format("rate").option("rowsPerSecond", 10)
            else:
                r = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", kafka.bootstrap_servers)
                     .option("kafka.group.id", "g").option("subscribe", "t").option("readMode", "executors"))
            q = (r.load().writeStream.foreachBatch(lambda df, _b: df.count()).option("checkpointLocation", ckpt)
                 .trigger(processingTime="1 second").start())
            first = q.lastProgress["batchId"] if q.lastProgress else -1
            while q.isActive and (not q.lastProgress or q.lastProgress["batchId"] < first + 2):
                q.awaitTermination(0.2)  # bounded: until this run has run two batches
            q.stop()
            counts.append(jvm_fds(jvm.pid))
            print(f"run {run}: JVM descriptors {counts[-1]}", flush=True)
    spark.stop()
    later = counts[1:]
    per_run = {k: (later[-1].get(k, 0) - later[0].get(k, 0)) / max(1, len(later) - 1) for k in later[-1]}
    print(f"{args.source}: per query run, after the first: {per_run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
