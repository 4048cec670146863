"""benchmark.py's table: the figures of one run's results (as written to results.json), printed as the
Markdown table docs/performance.md quotes, each beside its raw-loop figure, their ratio and the target.

It prints only: it must never measure, write a file or read figures from another run (a ratio is of two
figures measured side by side in the same run).
"""
from __future__ import annotations

import statistics

from bench_cpu import OURS


def _median(rows, key):
    return statistics.median(r[key] for r in rows)


def _throughput(results: dict, t: list[dict]) -> list[str]:
    """The throughput rows, and the line after the table on where a full batch's time goes."""
    share, busy, raw = _median(t, "share_rps"), _median(t, "share_busy_rps"), _median(t, "raw_rps")
    print(f"| throughput, records/s (wall, incl. query start) | {share:,.0f} | {raw:,.0f} | {share / raw:.2f} | >= 0.90 |")
    print(f"| throughput, records/s (inside batches) | {busy:,.0f} | {raw:,.0f} | {busy / raw:.2f} | >= 0.90 |")
    steady = _median(t, "share_steady_rps")
    print(f"| throughput, records/s (after the first batch) | {steady:,.0f} | {raw:,.0f} | {steady / raw:.2f} | >= 0.90 |")
    sc, rc = _median(t, "share_cpu_per_m"), _median(t, "raw_cpu_per_m")
    print(f"| CPU s per million records (whole run) | {sc:,.1f} | {rc:,.1f} | {sc / rc:.2f} | <= 1.5 |")
    ss = _median(t, "share_steady_cpu_per_m")
    print(f"| CPU s per million records (after the first batch) | {ss:,.1f} | {rc:,.1f} | {ss / rc:.2f} | <= 1.5 |")
    fc = _median(t, "floor_steady_cpu_per_m")
    print(f"| (context) Spark's floor: a Python source yielding prebuilt batches, same shape, CPU s per million "
          f"records after the first batch | {fc:,.1f} | | | |")
    print(f"| CPU s per million records above Spark's floor, after the first batch | {ss - fc:,.1f} | {rc:,.1f} "
          f"| {(ss - fc) / rc:.2f} | <= 1.0 |")
    if all("steady_cpu_per_m_by_process" in r for r in t):  # results.json of older runs have no split
        def by_process(key):
            return ", ".join(f"{k} {statistics.median(r[key].get(k, 0.0) for r in t):.1f}" for k in OURS
                             if any(k in r[key] for r in t))
        print(f"| CPU s per million records after the first batch, by process | {by_process('steady_cpu_per_m_by_process')}"
              f" | {rc:,.1f} (one process) | | |")
        print(f"| (context) Spark's floor, the same, by process | {by_process('floor_steady_cpu_per_m_by_process')}"
              " | | | |")
    print(f"| (context) Spark's floor, records/s after the first batch | {_median(t, 'floor_steady_rps'):,.0f} | | | |")
    print(f"| (context) query start -> end of the backlog's first batch, s | {_median(t, 'first_row_s'):.1f} | | | |")
    print(f"| AvailableNow: last batch with rows -> query end, s | {_median(t, 'end_after_last_s'):.1f} | | | <= 2 |")
    mb = _median(t, "mean_batch")
    if results.get("max_record_locks"):
        budget = results["partitions"] * results["max_record_locks"]
        print(f"| mean batch, records (lock budget {budget:,}) | {mb:,.0f} | | {mb / budget:.2f} | |")
    else:
        print(f"| mean batch, records (lock budget: the broker's) | {mb:,.0f} | | | |")
    sb, rb = _median(t, "share_broker_cpu_per_m"), _median(t, "raw_broker_cpu_per_m")
    print(f"| (context) embedded broker process, CPU s per million records | {sb:,.1f} | {rb:,.1f} | {sb / rb:.2f} | |")
    # Spark's phases of the full batches after the first (at least half the run's biggest).
    full = [p for r in t for p in r["phases"][1:] if p["rows"] >= 0.5 * max(q["rows"] for q in r["phases"])]
    if not full:
        return []
    keys = [k for k in full[0] if k not in ("batch", "rows")]
    return ["full batches after the first, median ms: " + ", ".join(
        f"{k} {statistics.median(p[k] for p in full):.0f}" for k in keys)
        + f" (rows {statistics.median(p['rows'] for p in full):.0f})"]


def print_table(results: dict) -> None:
    print("\n| measure | kafka-share | raw share consumer | ratio | target |")
    print("|---|---|---|---|---|")
    after = _throughput(results, results["throughput"]) if results.get("throughput") else []
    st = results.get("startup")
    if st and st["first_rows_s"]:
        f = st["first_rows_s"]
        print(f"| query start -> first rows in foreachBatch ({st['records']}-record topic, {len(f)} runs), s, "
              f"median (max) | {statistics.median(f):.1f} ({max(f):.1f}) | | | <= 3 |")
        e = st["end_after_rows_s"]
        print(f"| AvailableNow: first rows -> query end, same runs, s, median (max) | {statistics.median(e):.1f} "
              f"({max(e):.1f}) | | | <= 2 |")
    c = results.get("ceiling")
    if c:
        print(f"| embedded broker ceiling: raw loop, {c['consumers']} consumers, records/s | | {c['records_per_s']:,.0f} | | |")
    d = results.get("decode")
    if d:
        print(f"| decode rows/s, one core (vs naive lists) | {d['ours_rows_per_s']:,.0f} | {d['naive_rows_per_s']:,.0f} "
              f"| {d['ours_rows_per_s'] / d['naive_rows_per_s']:.2f} | >= 1M |")
    lt = results.get("latency")
    if lt:
        print(f"| ack latency p50 / p99 (commit -> confirmed) | {lt['ack_p50_ms']:.0f} / {lt['ack_p99_ms']:.0f} ms | | | 50 / 250 ms |")
        print(f"| end-to-end latency p50 / p99 | {lt['e2e_p50_s']:.2f} / {lt['e2e_p99_s']:.2f} s | | | p50 <= 1 s |")
    idle = results.get("idle")
    if idle:
        print(f"| idle: Spark jobs per minute, runner CPU | {idle['jobs_per_min']:.1f}, {idle['runner_cpu_percent']:.1f} % | | | <= 12 |")
    for r in results.get("scaling", []):
        print(f"| scaling numPartitions={r['slots']}: records/s | {r['share_rps']:,.0f} | {r['raw_rps']:,.0f} | "
              f"{r['share_rps'] / r['raw_rps']:.2f} | |")
    for r in results.get("batchsize", []):
        print(f"| batch size {r['mean_batch']:,.0f} (budget {r['budget']:,}): records/s after the first batch, "
              f"vs Spark's floor at that size | {r['share_steady_rps']:,.0f} | {r['floor_steady_rps']:,.0f} (floor) | "
              f"{r['share_steady_rps'] / r['floor_steady_rps']:.2f} | |")
    for line in after:
        print("\n" + line)
