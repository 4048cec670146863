"""readMode=driver beside readMode=executors and a raw share-consumer loop, measured side by side in one run.

    .venv/bin/python benchmarks/read_modes.py --records 200000 --ceiling-records 30000,3000 --out out   # embedded
    .venv/bin/python benchmarks/read_modes.py --bootstrap-servers broker:9092 [--kafka-option K=V ...]   # your cluster
    .venv/bin/python benchmarks/read_modes.py --chart-from A.json [B.json ...] [--chart-title T] --out DIR   # chart only

The embedded broker keeps about 5 MB a partition and drops older records: 1M records of 100 B on 8 partitions
(the default, for a real Kafka) would lose some there, and a run would wait for them forever.

For each record-lock limit (the broker's group.share.partition.max.record.locks; set on the embedded broker,
a cluster of yours keeps its own): a raw loop (one share consumer per partition, ACCEPT per record), then an
AvailableNow query (local[2], noop sink, the source's default read tasks) in each mode over a backlog of the
same shape: records/s from the query's start and after its first batch, and CPU seconds per million records
on the driver side (the source runner: with readMode=driver the consumers live there) and on the executor
side (Python workers, and with readMode=executors the agent). Then readMode=driver's ceiling through the
driver: records/s and MB/s at 1 KB and 10 KB values. Prints a table and the ratios, writes results.json and
read-modes.png (bench_charts.py); ``--chart-from`` draws read-modes.png from results files already written
(several: their runs merged by lock setting) and measures nothing.
Absolute numbers vary from run to run on a shared 2-core machine; the ratios of one run are what to compare.
Not part of the test run. It must never put the runs of two brokers in one chart or ratio unless told to
(``--chart-from`` with files of one broker), nor run a mode on a backlog another run has read.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench_charts import read_modes_chart
from bench_common import (
    add_kafka_arguments,
    backlog,
    cluster,
    comma_ints,
    local_session,
    parse_args,
    rounded,
    write_json,
)
from bench_cpu import BROKER, side_cpu_per_m
from bench_runs import raw_loop, share_run

DRIVER_SIDE = ("runner",)
EXECUTOR_SIDE = ("python workers", "agent")


def mode_run(spark, args, mode: str, locks: int, n: int, value_bytes: int, tmp: str) -> dict:
    with cluster(args) as kafka:
        topic = backlog(kafka, args.partitions, n, value_bytes, locks)
        r = share_run(spark, kafka, topic, None, n, tmp, locks=locks, readMode=mode)
    return {"mode": mode, "locks": locks, "value_bytes": value_bytes, "records": r["records"],
            "batches": r["batches"], "rps": r["records"] / r["seconds"],
            "steady_rps": r["steady_records"] / max(r["steady_seconds"], 1e-9),
            "mb_per_s": r["records"] * value_bytes / r["seconds"] / 1e6,
            "driver_cpu_per_m": side_cpu_per_m(r["cpu_by_process"], DRIVER_SIDE, r["records"]),
            "executor_cpu_per_m": side_cpu_per_m(r["cpu_by_process"], EXECUTOR_SIDE, r["records"]),
            "broker_cpu_per_m": side_cpu_per_m(r["cpu_by_process"], (BROKER,), r["records"]),
            "cpu_by_process": {k: round(v, 2) for k, v in r["cpu_by_process"].items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--value-bytes", type=int, default=100)
    ap.add_argument("--locks", default="2000,10000", help="record-lock limits to run at, comma-separated")
    ap.add_argument("--ceiling-records", default="200000,20000",
                    help="records of the 1 KB and the 10 KB ceiling runs (readMode=driver); the embedded broker keeps "
                    "about 5 MB a partition (older records are dropped): 30000,3000 there")
    ap.add_argument("--out", default="read-modes-out")
    ap.add_argument("--chart-from", nargs="+", metavar="RESULTS_JSON",
                    help="measure nothing: draw read-modes.png in --out from these results files")
    ap.add_argument("--chart-title", help="what the chart's title says ran (default: from the files)")
    add_kafka_arguments(ap)
    args = parse_args(ap, argv)
    chart = os.path.join(args.out, "read-modes.png")
    if args.chart_from:
        results = []
        for path in args.chart_from:
            with open(path) as f:
                results.append(json.load(f))
        if read_modes_chart(results, chart, args.chart_title):
            print(f"wrote {chart}")
        return 0
    spark = local_session()
    tmp = tempfile.mkdtemp(prefix="bench-modes-")
    results: dict = {"records": args.records, "partitions": args.partitions, "value_bytes": args.value_bytes,
                     "cluster": "yours" if args.bootstrap_servers else "embedded", "runs": [], "ceiling": []}
    # Warm-up, not measured: the session's first query pays JIT compilation and Python workers' start.
    for mode in ("executors", "driver"):
        mode_run(spark, args, mode, 2000, 20_000, args.value_bytes, tmp)
    for locks in comma_ints(args.locks):
        with cluster(args) as kafka:
            raw = raw_loop(kafka, backlog(kafka, args.partitions, args.records, args.value_bytes, locks),
                           args.partitions, args.records)
        row = {"mode": "raw loop", "locks": locks, "records": raw["records"], "rps": raw["records"] / raw["seconds"],
               "cpu_per_m": raw["cpu"] / raw["records"] * 1e6}
        print(json.dumps(row), flush=True)
        results["runs"].append(row)
        save(results, args.out)
        for mode in ("executors", "driver"):
            row = mode_run(spark, args, mode, locks, args.records, args.value_bytes, tmp)
            print(json.dumps(rounded(row, 1)), flush=True)
            results["runs"].append(row)
            save(results, args.out)
    for value_bytes, n in zip((1000, 10_000), comma_ints(args.ceiling_records)):
        row = mode_run(spark, args, "driver", 10_000, n, value_bytes, tmp)
        print("ceiling", json.dumps(rounded(row, 1)), flush=True)
        results["ceiling"].append(row)
        save(results, args.out)
    spark.stop()
    print(table(results))
    read_modes_chart([results], chart, args.chart_title)
    return 0


def save(results: dict, out: str) -> None:
    """results.json after every run: a run that fails later keeps what was measured."""
    write_json(os.path.join(out, "results.json"), results)


def table(results: dict) -> str:
    lines = ["| locks | mode | records/s from start | after the first batch | driver CPU-s/M | executor CPU-s/M |",
             "|---|---|---|---|---|---|"]
    by = {(r["locks"], r["mode"]): r for r in results["runs"]}
    for (locks, mode), r in by.items():
        if mode == "raw loop":
            lines.append(f"| {locks:,} | raw loop ({results['partitions']} consumers) | {r['rps']:,.0f} | - | "
                         f"{r['cpu_per_m']:.1f} (its process) | - |")
        else:
            lines.append(f"| {locks:,} | {mode} | {r['rps']:,.0f} | {r['steady_rps']:,.0f} | "
                         f"{r['driver_cpu_per_m']:.1f} | {r['executor_cpu_per_m']:.1f} |")
    for locks in sorted({r["locks"] for r in results["runs"]}):
        d, e, raw = by.get((locks, "driver")), by.get((locks, "executors")), by.get((locks, "raw loop"))
        if d and e and raw:
            lines.append(f"\nlocks {locks:,}: driver/executors {d['rps'] / e['rps']:.2f} from start, "
                         f"{d['steady_rps'] / e['steady_rps']:.2f} after the first batch; driver/raw {d['rps'] / raw['rps']:.2f}")
    for c in results["ceiling"]:
        lines.append(f"\nreadMode=driver at {c['value_bytes']:,} B values: {c['rps']:,.0f} records/s, "
                     f"{c['mb_per_s']:.0f} MB/s through the driver")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
