"""One measured run of each reader the benchmarks compare: a raw share-consumer loop (in a process of
its own), a kafka-share query over a backlog, Spark's floor (bench_floor.py) with a given batch shape,
and a query's start to its first rows. Each returns its numbers: times, records, CPU by process, Spark's
per-batch phases and the tracker's view of each batch.

It must never print, compare or judge a figure (the scripts do), and never leave a query running: every
query it starts is AvailableNow and awaited.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

from bench_common import backlog
from bench_cpu import CpuSampler

# The raw loop: one thread and one share consumer per ``consumers``, polling and acknowledging each record
# until the backlog is read; run in a process of its own so that its CPU is its own.
RAW_LOOP = r"""
import json, sys, threading, time, resource
from confluent_kafka import ShareConsumer, AcknowledgeType
cfg = json.loads(sys.stdin.readline())  # on stdin: client options may hold credentials
group, topic, consumers, n = cfg["group"], cfg["topic"], cfg["consumers"], cfg["records"]
got = [0] * consumers
start = threading.Barrier(consumers + 1)
def run(i):
    c = ShareConsumer({**cfg["client"], "group.id": group, "share.acknowledgement.mode": "explicit",
                       "max.poll.records": "10000"})
    c.subscribe([topic])
    start.wait()
    while sum(got) < n:
        msgs = c.poll(0.2)
        for m in msgs:
            if m.error() is None:
                c.acknowledge(m, AcknowledgeType.ACCEPT)
                got[i] += 1
    c.commit_sync(30)
    c.close()
threads = [threading.Thread(target=run, args=(i,)) for i in range(consumers)]
for t in threads: t.start()
start.wait()
t0 = time.perf_counter(); r0 = resource.getrusage(resource.RUSAGE_SELF)
for t in threads: t.join()
dt = time.perf_counter() - t0; r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "records": sum(got),
                  "cpu": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)}))
"""


def raw_loop(kafka, topic, consumers, n):
    group = kafka.group(f"raw-{uuid.uuid4().hex[:6]}")
    cfg = {"client": kafka.client(), "group": group, "topic": topic, "consumers": consumers, "records": n}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", RAW_LOOP], input=json.dumps(cfg) + "\n", capture_output=True,
                         text=True, timeout=600)
    # "seconds" counts from its consumers' subscribe; "process_seconds" from the process's start.
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "process_seconds": time.perf_counter() - started}


def spark_phases(q) -> list[dict]:
    """Spark's durations of each batch of query ``q`` (ms), with its id and rows."""
    return [dict(batch=p["batchId"], rows=p["numInputRows"], **{k: v for k, v in p["durationMs"].items()
                                                                 if k != "getBatch"}) for p in q.recentProgress]


def batch_end(p) -> float:
    """Wall-clock time a progress event's batch ended."""
    from datetime import datetime

    started = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
    return started + p["durationMs"].get("triggerExecution", 0) / 1000.0


def share_stream(spark, kafka, topic, group=None, **options):
    """readStream.format("kafka-share") on ``kafka`` (its client options as kafka.*), the group ``group``
    (a name ``kafka.group`` maps, set to start at the earliest record); readMode=executors, as the figures
    quoted from here were measured, unless ``readMode`` is given (read_modes.py compares the two)."""
    group = kafka.group(group or f"share-{uuid.uuid4().hex[:6]}")
    r = spark.readStream.format("kafka-share").option("kafka.group.id", group).option("subscribe", topic)
    for k, v in kafka.client().items():
        r = r.option("kafka." + k, v)
    for k, v in {"readMode": "executors", **options}.items():
        if v is not None:  # numPartitions=None: the source's default
            r = r.option(k, str(v))
    return r


def available_now(writer, tmp: str):
    """``writer`` started as an AvailableNow query, its checkpoint new under ``tmp``."""
    return writer.option("checkpointLocation", os.path.join(tmp, uuid.uuid4().hex)).trigger(availableNow=True).start()


def _await(q, cpu: CpuSampler, every=None):
    """Waits for the AvailableNow query ``q`` to end, calling ``every`` each half second meanwhile; returns
    (time, CPU, CPU by process) when its first batch was done (the query, agent and consumer start-up),
    None if it reported no batch."""
    first, asked = None, 0.0
    while not q.awaitTermination(0.1):
        if first is None and q.lastProgress:
            first = (time.perf_counter(), cpu.seconds, cpu.by_kind)
        if every and time.perf_counter() - asked > 0.5:
            asked = time.perf_counter()
            every()
    return first


def share_run(spark, kafka, topic, slots, n, tmp, locks=None, group=None, sink=None, **options):
    """An AvailableNow query over the backlog ``topic`` (``n`` records) into the noop sink (or
    ``sink``, a foreachBatch function), ``slots`` read tasks (None: the source's default), other source
    ``options`` as given: its times, CPU by process, Spark's per-batch phases and the tracker's view of
    each batch."""
    import spark_share
    from spark_share.embedded import EmbeddedKafka

    r = share_stream(spark, kafka, topic, group=group, numPartitions=slots, **options)
    if locks and isinstance(kafka, EmbeddedKafka):
        r = r.option("maxRecordLocks", str(locks))
    df = r.load()
    tracked = {}  # the tracker's summary of each batch (it keeps the last few)

    def track():
        try:
            tracked.update((b["batch"], b) for b in spark_share.status(q).get("batches", []))
        except Exception:  # not started yet, or just ended
            pass

    with CpuSampler() as cpu:
        t0 = time.perf_counter()
        wall0 = time.time()
        q = available_now(df.writeStream.foreachBatch(sink) if sink else df.writeStream.format("noop"), tmp)
        first = _await(q, cpu, track)
        end = time.perf_counter()
        wall_end = time.time()
        wall = end - t0
    if q.exception() is not None or sum(p["numInputRows"] for p in q.recentProgress) < n:
        raise RuntimeError(f"kafka-share read {sum(p['numInputRows'] for p in q.recentProgress):,} of the {n:,} "
                           f"records of the backlog (query exception: {q.exception()})")
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    # Query start -> its first batch with rows written; that batch's end -> the run's end.
    first_row_s = batch_end(prog[0]) - wall0 if prog else None
    end_after_last_s = wall_end - batch_end(prog[-1]) if prog else None
    rows = sum(p["numInputRows"] for p in prog)
    busy = sum(p["durationMs"]["triggerExecution"] for p in prog) / 1000.0
    after_first = rows - (prog[0]["numInputRows"] if prog else 0)
    first = first or (t0, 0.0, {})
    return {"seconds": wall, "busy_seconds": busy, "records": rows, "batches": len(prog), "cpu": cpu.seconds,
            "tracked": [tracked[k] for k in sorted(tracked)],
            "first_row_s": first_row_s, "end_after_last_s": end_after_last_s,
            "mean_batch": rows / max(1, len(prog)),
            "progress_max_bytes": max((len(p.json) if hasattr(p, "json") else len(json.dumps(p))
                                       for p in q.recentProgress), default=0),
            "phases": spark_phases(q),
            "cpu_by_process": cpu.by_kind, "steady_records": after_first,
            "steady_seconds": end - first[0], "steady_cpu": cpu.seconds - first[1],
            "steady_cpu_by_process": {k: round(v - first[2].get(k, 0.0), 2) for k, v in cpu.by_kind.items()},
            "steady_cpu_per_m_by_process": {k: (v - first[2].get(k, 0.0)) / max(after_first, 1) * 1e6
                                            for k, v in cpu.by_kind.items()}}


def floor_run(spark, batches, tasks, rows, tmp, value_bytes: int = 100):
    """Spark's own cost for a Python streaming source that does no work (bench_floor.py)."""
    with CpuSampler() as cpu:
        t0 = time.perf_counter()
        q = available_now(spark.readStream.format("spark-share-floor").option("batches", batches)
                          .option("tasks", tasks).option("rows", rows).option("valueBytes", value_bytes).load()
                          .writeStream.format("noop"), tmp)
        first = _await(q, cpu)
        end = time.perf_counter()
    records = sum(p["numInputRows"] for p in q.recentProgress)
    first = first or (t0, 0.0, {})
    steady = records - tasks * rows
    return {"records": records, "rps": records / (end - t0), "steady_rps": steady / (end - first[0]),
            "phases": spark_phases(q),
            "cpu_per_m": cpu.seconds / records * 1e6, "steady_cpu_per_m": (cpu.seconds - first[1]) / steady * 1e6,
            "cpu_by_process": {k: round(v, 2) for k, v in cpu.by_kind.items()},
            "steady_cpu_per_m_by_process": {k: (v - first[2].get(k, 0.0)) / steady * 1e6 for k, v in cpu.by_kind.items()}}


def floor_beside(spark, run: dict, slots: int, n: int, tmp: str, value_bytes: int = 100) -> dict:
    """Spark's floor with the shape of a kafka-share ``run`` over ``n`` records: as many batches with rows,
    ``slots`` tasks each, as many rows per task, as many bytes per value."""
    full = [p for p in run["phases"] if p["rows"]]
    return floor_run(spark, len(full), slots, max(1, n // max(1, len(full)) // slots), tmp, value_bytes)


def first_rows(spark, kafka, topic, tmp, **options) -> tuple[float | None, float | None]:
    """Query start -> the first rows counted in foreachBatch, and those rows -> the AvailableNow query's end
    (None, None if no rows came within 300 s)."""
    seen: dict[str, float] = {}

    def count(df, _batch_id):  # counts every batch, as a sink would read it
        if df.count() and "rows" not in seen:
            seen["rows"] = time.perf_counter()

    t0 = time.perf_counter()
    q = available_now(share_stream(spark, kafka, topic, **options).load().writeStream.foreachBatch(count), tmp)
    q.awaitTermination(300)
    if "rows" not in seen:
        return None, None
    return seen["rows"] - t0, time.perf_counter() - seen["rows"]


def warm_up(spark, kafka, partitions: int, tmp: str, locks: int | None = None) -> None:
    """One query, not measured: Spark's first query pays JIT compilation and the start of its Python
    planning workers (each imports pyspark); a scheduled job pays that too, a stream once."""
    share_run(spark, kafka, backlog(kafka, partitions, 20_000, locks=locks), 2, 20_000, tmp)
