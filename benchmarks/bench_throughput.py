"""benchmark.py's throughput sections: the broker's ceiling (a raw loop, one consumer per partition), the
throughput and scaling rows (kafka-share beside a raw loop with as many consumers and beside Spark's floor
with the same batch shape), and the batch-size sweep (records/s against the lock budget).

Each row is measured side by side in one run, on a fresh cluster per reader, and printed as it ends. It
must never reuse a backlog between two readers (the second would find it read), nor compare rows of
different runs.
"""
from __future__ import annotations

import json

from bench_common import backlog, cluster, rounded
from bench_cpu import BROKER, CpuSampler
from bench_runs import floor_beside, raw_loop, share_run

from harness.kafka_cluster import EmbeddedCluster

BATCH_SIZES = (5_000, 10_000, 20_000, 40_000, 80_000)


def ceiling(args) -> dict:
    """The broker's own ceiling: a raw loop with one consumer per partition."""
    with cluster(args) as kafka:
        topic = backlog(kafka, args.partitions, args.records, locks=args.max_record_locks)
        raw = raw_loop(kafka, topic, args.partitions, args.records)
    return {"consumers": args.partitions, "records_per_s": raw["records"] / raw["seconds"]}


def compare(spark, args, slots: int, tmp: str) -> dict:
    """kafka-share with ``slots`` read tasks beside a raw loop of ``slots`` consumers (the embedded broker's
    CPU counted meanwhile) and Spark's floor with the same shape."""
    with cluster(args) as kafka:
        topic = backlog(kafka, args.partitions, args.records, locks=args.max_record_locks)
        with CpuSampler() as broker:
            raw = raw_loop(kafka, topic, slots, args.records)
    with cluster(args) as kafka:
        ours = share_run(spark, kafka, backlog(kafka, args.partitions, args.records, locks=args.max_record_locks),
                         slots, args.records, tmp, locks=args.max_record_locks)
    # Spark's floor with the same shape: as many batches and tasks, as many rows per task.
    floor = floor_beside(spark, ours, slots, args.records, tmp)
    return {"slots": slots, "raw_rps": raw["records"] / raw["seconds"],
            "floor_rps": floor["rps"], "floor_steady_rps": floor["steady_rps"],
            "floor_cpu_per_m": floor["cpu_per_m"], "floor_steady_cpu_per_m": floor["steady_cpu_per_m"],
            "floor_cpu_by_process": floor["cpu_by_process"],
            "floor_steady_cpu_per_m_by_process": floor["steady_cpu_per_m_by_process"],
            "share_rps": ours["records"] / ours["seconds"],
            "share_busy_rps": ours["records"] / max(ours["busy_seconds"], 1e-9),
            "raw_cpu_per_m": raw["cpu"] / raw["records"] * 1e6,
            "share_cpu_per_m": ours["cpu"] / max(ours["records"], 1) * 1e6,
            "share_steady_rps": ours["steady_records"] / max(ours["steady_seconds"], 1e-9),
            "share_steady_cpu_per_m": ours["steady_cpu"] / max(ours["steady_records"], 1) * 1e6,
            "batches": ours["batches"], "records": ours["records"], "mean_batch": ours["mean_batch"],
            "first_row_s": ours["first_row_s"], "end_after_last_s": ours["end_after_last_s"],
            "raw_broker_cpu_per_m": broker.by_kind.get(BROKER, 0) / raw["records"] * 1e6,
            "share_broker_cpu_per_m": ours["cpu_by_process"].get(BROKER, 0) / max(ours["records"], 1) * 1e6,
            "cpu_by_process": {k: round(v, 2) for k, v in ours["cpu_by_process"].items()},
            "steady_cpu_by_process": ours["steady_cpu_by_process"],
            "steady_cpu_per_m_by_process": ours["steady_cpu_per_m_by_process"],
            "phases": ours["phases"]}


def compare_rows(spark, args, section: str, slot_list, repeats: int, tmp: str) -> list[dict]:
    """``compare`` for each of ``slot_list``, ``repeats`` times each, each row printed as it ends."""
    rows = []
    for slots in slot_list:
        for _ in range(repeats):
            row = compare(spark, args, slots, tmp)
            print(section, json.dumps(rounded(row, 2)), flush=True)
            rows.append(row)
    return rows


def batch_size_sweep(spark, args, tmp, slots=2):
    """records/s against batch size: the lock budget (partitions x record locks) sets the size of a
    backlog's batches; Spark's floor runs batches of the same size next to it. Embedded broker only: it
    sets the broker's record locks."""
    rows = []
    for size in BATCH_SIZES:
        locks = max(1, size // args.partitions)
        n = max(args.records, 3 * size)
        with EmbeddedCluster() as kafka:
            ours = share_run(spark, kafka, backlog(kafka, args.partitions, n, locks=locks), slots, n, tmp, locks=locks)
        floor = floor_beside(spark, ours, slots, n, tmp)
        row = {"budget": locks * args.partitions, "mean_batch": ours["mean_batch"],
               "share_steady_rps": ours["steady_records"] / max(ours["steady_seconds"], 1e-9),
               "floor_steady_rps": floor["steady_rps"], "first_row_s": ours["first_row_s"]}
        print("batchsize", json.dumps(rounded(row, 2)), flush=True)
        rows.append(row)
    return rows
