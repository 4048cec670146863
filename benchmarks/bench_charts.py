"""The benchmarks' charts, drawn from their results (the dicts they write as JSON): benchmark.py's
throughput.png, cpu.png and batch-size.png, targets.py's targets.png, and read_modes.py's read-modes.png.

It draws only what a results file holds: it must never measure or rerun anything, and never mix the
runs of two brokers in one chart without saying which is which (the title names the broker). Without
matplotlib (``pip install 'spark-share[bench]'``) it says so and draws nothing.
"""
from __future__ import annotations

import math
import os
import statistics


def pyplot(what: str = "no plots"):
    """matplotlib's pyplot drawing to files, or None (said) when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: {what}; pip install 'spark-share[bench]')")
        return None
    return plt


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path)


def _lines(plt, path, rows, x, series, xlabel, title, log=False):
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r[x] for r in rows]
    for key, style, label in series:
        ax.plot(xs, [r[key] for r in rows], style, label=label)
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("records/s")
    ax.set_title(title)
    ax.legend()
    _save(fig, path)


def benchmark_charts(results: dict, out: str) -> None:
    """benchmark.py's charts (embedded broker): throughput against read tasks, CPU per million records,
    throughput against batch size; each drawn when its section ran."""
    plt = pyplot()
    if plt is None:
        return
    if results.get("scaling"):
        _lines(plt, os.path.join(out, "throughput.png"), results["scaling"], "slots",
               [("raw_rps", "o-", "raw ShareConsumer loop"), ("share_rps", "o-", "kafka-share -> noop (wall)"),
                ("share_steady_rps", "o--", "kafka-share (after the first batch)")],
               "consumers (numPartitions)", "Throughput on the embedded broker")
    if results.get("throughput"):
        fig, ax = plt.subplots(figsize=(6, 4))
        t = results["throughput"]
        ax.bar(["raw loop", "kafka-share\n(whole run)", "kafka-share\n(after 1st batch)",
                "Spark's floor\n(after 1st batch)"],
               [statistics.median(r[k] for r in t)
                for k in ("raw_cpu_per_m", "share_cpu_per_m", "share_steady_cpu_per_m", "floor_steady_cpu_per_m")])
        ax.set_ylabel("CPU seconds per million records")
        ax.set_title("CPU cost (agents, runner, Python workers; not the JVM)")
        _save(fig, os.path.join(out, "cpu.png"))
    if results.get("batchsize"):
        _lines(plt, os.path.join(out, "batch-size.png"), results["batchsize"], "mean_batch",
               [("share_steady_rps", "o-", "kafka-share (after the first batch)"),
                ("floor_steady_rps", "o--", "Spark's floor, same batches")],
               "records per batch (set by the lock budget)", "Throughput against batch size, embedded broker", log=True)


def targets_chart(results: dict, out: str) -> None:
    """targets.py's chart (real Kafka): records/s after the first batch against batch size, each run, with
    Spark's floor at the same batches and the lock-budget bound."""
    plt = pyplot("no plot")
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in results["settings"]:
        for key in s["rounds"][0]["runs"]:
            pts = [(r["runs"][key]["mean_batch"], r["runs"][key]["steady_records"] / r["runs"][key]["steady_seconds"])
                   for r in s["rounds"]]
            label = f"{s['locks']:,} locks, numPartitions {'unset' if key == 'default' else key}"
            ax.plot(*zip(*pts), "o", label=label)
        fl = [(r["runs"]["default"]["mean_batch"], r["floor"]["steady_rps"]) for r in s["rounds"]]
        ax.plot(*zip(*fl), "k^", label=f"Spark's floor, same batches ({s['locks']:,} locks)")
        bounds = [(r["runs"]["default"]["mean_batch"], r["runs"]["default"]["bound_rps"]) for r in s["rounds"]
                  if "bound_rps" in r["runs"]["default"]]
        if bounds:
            ax.plot(*zip(*bounds), "r_", markersize=25, label=f"lock-budget bound ({s['locks']:,} locks)")
    ax.set_xscale("log")
    ax.set_xlabel("records per batch")
    ax.set_ylabel("records/s after the first batch")
    ax.set_title("Throughput against batch size, real Kafka 4.2")
    ax.legend(fontsize=7)
    _save(fig, os.path.join(out, "targets.png"))


# read-modes.png: (mode, field, label, colour, hatch) of each bar of a lock setting's group.
_SPEED_BARS = (("raw loop", "rps", "raw loop, one consumer per partition (from its subscribe)", "0.55", None),
               ("executors", "rps", "readMode=executors, from query start", "C0", None),
               ("executors", "steady_rps", "readMode=executors, after the first batch", "C0", "//"),
               ("driver", "rps", "readMode=driver, from query start", "C1", None),
               ("driver", "steady_rps", "readMode=driver, after the first batch", "C1", "//"))


def read_modes_chart(results: list[dict], path: str, title: str | None = None) -> bool:
    """read_modes.py's chart from one or more of its results files (their runs merged by lock setting):
    records/s of each mode from query start and after the first batch beside the raw loop, and CPU-s per
    million records on the driver's side and the executors' (the raw loop: its one process)."""
    plt = pyplot("no chart")
    if plt is None:
        return False
    runs = {(r["locks"], r["mode"]): r for res in results for r in res["runs"]}
    locks = sorted({lk for lk, _ in runs})
    first = results[0]
    shape = f"{first['records']:,} records of {first['value_bytes']:,} B on {first['partitions']} partitions"
    broker = "embedded broker (librdkafka's mock)" if first.get("cluster") == "embedded" else "a Kafka broker"
    fig, (speed, cpu) = plt.subplots(1, 2, figsize=(12, 6.4))
    groups = range(len(locks))

    def value(lk, mode, key):
        return runs.get((lk, mode), {}).get(key, math.nan)

    width = 0.16
    for i, (mode, key, label, colour, hatch) in enumerate(_SPEED_BARS):
        bars = speed.bar([g + (i - 2) * width for g in groups], [value(lk, mode, key) for lk in locks], width,
                         label=label, color=colour, alpha=0.55 if hatch else 1.0, hatch=hatch, edgecolor="black",
                         linewidth=0.4)
        speed.bar_label(bars, fmt="{:,.0f}", fontsize=6, padding=2)
    speed.set_ylabel("records/s")
    speed.set_title("Records/s")
    speed.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _pos: f"{y:,.0f}"))
    width = 0.25
    for i, (mode, colour) in enumerate((("raw loop", "0.55"), ("executors", "C0"), ("driver", "C1"))):
        xs = [g + (i - 1) * width for g in groups]
        if mode == "raw loop":
            totals = [value(lk, mode, "cpu_per_m") for lk in locks]
            bars = cpu.bar(xs, totals, width, color=colour, edgecolor="black", linewidth=0.4,
                           label="raw loop: its process")
        else:
            ds = [value(lk, mode, "driver_cpu_per_m") for lk in locks]
            es = [value(lk, mode, "executor_cpu_per_m") for lk in locks]
            totals = [d + e for d, e in zip(ds, es)]
            cpu.bar(xs, ds, width, color=colour, edgecolor="black", linewidth=0.4,
                    label=f"readMode={mode}: driver side (source runner)")
            bars = cpu.bar(xs, es, width, bottom=ds, color=colour, alpha=0.55, hatch="//", edgecolor="black",
                           linewidth=0.4,
                           label=f"readMode={mode}: executor side (Python workers{', agent' if mode == 'executors' else ''})")
        # A stack is labelled with its total (driver + executor side).
        cpu.bar_label(bars, labels=[f"{t:.1f}" for t in totals], fontsize=7, padding=2)
    cpu.set_ylabel("CPU seconds per million records")
    cpu.set_title("CPU-s per million records, by side (Spark's JVM not counted)")
    for ax in (speed, cpu):
        ax.set_xticks(list(groups), [f"{lk:,} record locks" for lk in locks])
        ax.margins(y=0.1)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.suptitle(f"Read modes beside a raw share-consumer loop\n{title or broker}; {shape}", fontsize=10)
    _save(fig, path)
    return True
