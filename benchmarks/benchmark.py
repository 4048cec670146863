"""Benchmarks: kafka-share against a raw share consumer, side by side, on one embedded broker.

    .venv/bin/python benchmarks/benchmark.py [--records 100000] [--repeats 3] [--out bench-out]
    .venv/bin/python benchmarks/benchmark.py --bootstrap-servers broker:9092 [--kafka-option K=V ...]   # your cluster

Prints a table and writes results.json and PNG plots to --out. Absolute numbers vary from run to
run on a shared 2-core machine; the ratios, measured in the same run, are what to compare.
Not part of the test run.

This module owns the command line and the order of the sections; each section is measured in a module of
its own (bench_decode.py, bench_throughput.py, bench_latency.py), printed by bench_report.py and drawn by
bench_charts.py. It must never compare figures of two runs: every ratio it prints is of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import psutil
from bench_charts import benchmark_charts
from bench_common import add_kafka_arguments, cluster, comma_set, local_session, parse_args, write_json
from bench_decode import decode_bench
from bench_latency import idle_bench, latency_bench, startup_bench
from bench_report import print_table
from bench_runs import warm_up
from bench_throughput import batch_size_sweep, ceiling, compare_rows

SECTIONS = "throughput,ceiling,scaling,startup,batchsize,latency,idle,decode"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--max-record-locks", type=int, default=2000,
                    help="the broker's per-partition in-flight limit (Kafka's group.share.partition.max.record.locks)")
    add_kafka_arguments(ap)
    ap.add_argument("--skip", default="", help=f"comma-separated sections to skip: {SECTIONS}")
    args = parse_args(ap, argv)
    skip = comma_set(args.skip)
    results = {"machine": {"cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30)},
               "records": args.records, "partitions": args.partitions,
               "max_record_locks": None if args.bootstrap_servers else args.max_record_locks,
               "cluster": "yours" if args.bootstrap_servers else "embedded"}
    if "decode" not in skip:
        results["decode"] = decode_bench()
        print("decode:", json.dumps(results["decode"]))
    spark = local_session(floor=True)
    tmp = tempfile.mkdtemp(prefix="bench-")
    try:
        with cluster(args) as kafka:
            warm_up(spark, kafka, args.partitions, tmp, locks=args.max_record_locks)
        if "ceiling" not in skip:
            results["ceiling"] = ceiling(args)
            print("ceiling:", json.dumps(results["ceiling"]), flush=True)
        for section, slot_list, repeats in (("throughput", [2], args.repeats), ("scaling", [1, 2, 4], 1)):
            if section not in skip:
                results[section] = compare_rows(spark, args, section, slot_list, repeats, tmp)
        if "startup" not in skip:
            results["startup"] = startup_bench(spark, args, tmp)
        if "batchsize" not in skip:
            if args.bootstrap_servers:
                print("batchsize: skipped on a cluster of yours (it sets the broker's record locks)")
            else:
                results["batchsize"] = batch_size_sweep(spark, args, tmp)
        for section, bench in (("latency", latency_bench), ("idle", idle_bench)):
            if section not in skip:  # each on a cluster of its own: a stream, not a backlog
                with cluster(args) as kafka:
                    results[section] = bench(spark, kafka)
                print(f"{section}:", json.dumps(results[section]))
    finally:
        spark.stop()
    write_json(os.path.join(args.out, "results.json"), results, indent=2)
    print_table(results)
    benchmark_charts(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
