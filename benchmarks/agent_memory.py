"""An agent's memory bound (``agentCacheBytes``), measured side by side in one run: readMode=executors with the
default budget (256 MiB: every batch held in memory) beside a budget of 0 (every batch waits for its
acknowledgement in a mapped file of the executor's local dir).

    .venv/bin/python benchmarks/agent_memory.py --records 30000 --value-bytes 1000            # embedded
    .venv/bin/python benchmarks/agent_memory.py --bootstrap-servers broker:9092 --records 300000 [--kafka-option K=V]

For each budget: an AvailableNow query (local[2], 8 partitions, the backlog in ``--batches`` batches, a
sink that counts each batch and takes 2 s, as a slow sink would, while the agent holds the batch) over the
same backlog; records/s from the query's start, CPU seconds per million records of the agent, and the
agent's memory, sampled every 50 ms from /proc: anonymous (median and peak: what the budget bounds) and
file-backed (mapped batches: the kernel may drop those pages). Prints a table and the ratios, writes results.json.
The embedded broker keeps about 5 MB a partition: keep records x value bytes under 40 MB there.
Not part of the test run. It must never keep the first round (it warms the session up), nor read the
memory of a process that is not an agent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench_common import add_kafka_arguments, backlog, cluster, local_session, parse_args, rounded, write_json
from bench_cpu import Sampler, side_cpu_per_m
from bench_runs import share_run

from harness.support import agent_processes

BUDGETS = (("default (256 MiB)", None), ("0: every batch mapped", 0))
HOLD_S = 2.0  # the sink's time per batch (a slow sink): the agent holds the batch meanwhile


def slow_sink(df, batch_id) -> None:
    df.count()
    time.sleep(HOLD_S)  # stands for a sink's write, not a wait for something


class PeakMemory(Sampler):
    """The largest RssAnon and RssFile (MiB) of any agent while the ``with`` lasts, and RssAnon's median."""

    interval = 0.05

    def __init__(self):
        super().__init__()
        self.anon = self.file = 0.0
        self.anon_samples: list[float] = []

    def sample(self) -> None:
        for p in agent_processes():
            try:
                with open(f"/proc/{p.pid}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            anon = int(fields.get("RssAnon", "0 kB").split()[0]) / 1024
            self.anon_samples.append(anon)
            self.anon = max(self.anon, anon)
            self.file = max(self.file, int(fields.get("RssFile", "0 kB").split()[0]) / 1024)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--value-bytes", type=int, default=1000)
    ap.add_argument("--locks", type=int, default=10_000, help="record-lock limit (set on the embedded broker)")
    ap.add_argument("--batches", type=int, default=3, help="the backlog is read in this many batches")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each budget, alternating")
    ap.add_argument("--out", default="agent-memory-out")
    add_kafka_arguments(ap)
    args = parse_args(ap, argv)
    spark = local_session()
    tmp = tempfile.mkdtemp(prefix="bench-agent-memory-")
    runs = []
    for i in range(args.repeats + 1):  # the first round warms the session up and is not kept
        for name, budget in BUDGETS:
            with cluster(args) as kafka:
                topic = backlog(kafka, args.partitions, args.records, args.value_bytes, args.locks)
                with PeakMemory() as peak:
                    r = share_run(spark, kafka, topic, None, args.records, tmp, locks=args.locks, sink=slow_sink,
                                  readMode="executors", agentCacheBytes=budget,
                                  maxRecordsPerTrigger=args.records // args.batches)
            row = {"budget": name, "rps": r["records"] / r["seconds"], "batches": r["batches"],
                   "agent_cpu_per_m": side_cpu_per_m(r["cpu_by_process"], ("agent",), r["records"]),
                   "peak_anon_mib": peak.anon, "median_anon_mib": statistics.median(peak.anon_samples or [0.0]),
                   "peak_file_mib": peak.file}
            print(("warm-up " if i == 0 else "") + json.dumps(rounded(row, 1)), flush=True)
            if i:
                runs.append(row)
    spark.stop()
    write_json(os.path.join(args.out, "results.json"),
               {"records": args.records, "value_bytes": args.value_bytes, "runs": runs})
    print(table(runs, args))
    return 0


def table(runs: list[dict], args) -> str:
    lines = [f"{args.records:,} records of {args.value_bytes:,} B, {args.partitions} partitions, readMode=executors",
             "| agentCacheBytes | records/s | agent CPU-s/M | agent anonymous MiB, median / peak | agent peak mapped MiB |",
             "|---|---|---|---|---|"]
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["budget"], []).append(r)
        lines.append(f"| {r['budget']} | {r['rps']:,.0f} | {r['agent_cpu_per_m']:.1f} | {r['median_anon_mib']:.0f} / "
                     f"{r['peak_anon_mib']:.0f} | {r['peak_file_mib']:.0f} |")
    (d, dr), *others = list(by.items())
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    for z, zr in others:
        lines.append(f"\n{z} / {d}: records/s {mean(zr, 'rps') / mean(dr, 'rps'):.2f}, agent anonymous memory "
                     f"{mean(zr, 'median_anon_mib') / max(mean(dr, 'median_anon_mib'), 1e-9):.2f} (median), "
                     f"{mean(zr, 'peak_anon_mib') / max(mean(dr, 'peak_anon_mib'), 1e-9):.2f} (peak)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
