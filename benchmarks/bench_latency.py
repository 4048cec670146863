"""benchmark.py's time sections: start-up (query start -> first rows in foreachBatch on a small topic),
latency under a light paced load (produce -> foreachBatch, commit -> acknowledgements confirmed), and an
idle stream's cost (Spark jobs per minute, the source runner's CPU).

It must never count the first batches of a stream (the consumers' group join) as latency, nor leave a
stream running: every query it starts it stops.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import psutil
from bench_common import backlog, cluster, pct
from bench_cpu import cpu_seconds
from bench_runs import first_rows, share_stream


def startup_bench(spark, args, tmp, runs=5, records=100):
    """Query start -> the first rows in foreachBatch (counted there), on a fresh topic of ``records``
    in a warm Spark session: what a scheduled job waits before its data arrives (the agent's start,
    the group join and the first poll), apart from the time a big first batch takes."""
    firsts, ends = [], []
    for _ in range(runs):
        with cluster(args) as kafka:
            topic = backlog(kafka, args.partitions, records, locks=args.max_record_locks)
            first, end = first_rows(spark, kafka, topic, tmp, numPartitions=2)
            if first is not None:
                firsts.append(first)
                ends.append(end)
    out = {"runs": runs, "records": records, "first_rows_s": firsts, "end_after_rows_s": ends}
    print("startup:", json.dumps({k: [round(x, 2) for x in v] if isinstance(v, list) else v for k, v in out.items()}),
          flush=True)
    return out


def latency_bench(spark, kafka, seconds=20, rate=200):
    """Default trigger, light paced load: produce -> foreachBatch latency, and commit -> acks confirmed."""
    from confluent_kafka import Producer

    import spark_share

    topic = kafka.create_topic("lat", 2)
    lat = []
    ck = tempfile.mkdtemp(prefix="bench-lat-")

    def sink(df, batch_id):
        now = time.time()
        for r in df.select("value").collect():
            lat.append(now - float(r[0]))

    df = share_stream(spark, kafka, topic, pollTimeoutMs=200).load()
    q = df.writeStream.foreachBatch(sink).option("checkpointLocation", ck).start()
    p = Producer({**kafka.client(), "linger.ms": 0})
    time.sleep(8)  # let the first batches (consumer join) pass before measuring
    lat.clear()
    t0 = time.time()
    i = 0
    while time.time() - t0 < seconds:
        p.produce(topic, value=repr(time.time()).encode(), partition=i % 2)
        p.poll(0)
        i += 1
        time.sleep(1.0 / rate)
    p.flush(10)
    time.sleep(3)
    acks = []
    for b in spark_share.status(q)["batches"]:
        commit = os.path.join(ck, "commits", str(b["batch"]))
        if b.get("acquired") and b.get("ackedAt") and os.path.exists(commit):
            acks.append(b["ackedAt"] - os.path.getmtime(commit))
    q.stop()
    return {"e2e_p50_s": pct(lat, 50), "e2e_p99_s": pct(lat, 99), "e2e_samples": len(lat),
            "ack_p50_ms": 1000 * pct(acks, 50), "ack_p99_ms": 1000 * pct(acks, 99), "ack_samples": len(acks)}


def idle_bench(spark, kafka, seconds=60):
    """A stream on an empty topic, default trigger: Spark jobs per minute and the source runner's CPU."""
    df = share_stream(spark, kafka, kafka.create_topic("idle", 2)).load()
    q = df.writeStream.format("noop").option("checkpointLocation", tempfile.mkdtemp(prefix="bench-idle-")).start()
    time.sleep(10)  # past the first (probe) batch
    runner = [p for p in psutil.process_iter(["cmdline"])
              if any("python_streaming_source_runner" in c for c in (p.info["cmdline"] or []))]
    cpu0 = cpu_seconds(runner)
    b0 = q.lastProgress["batchId"] if q.lastProgress else 0
    time.sleep(seconds)
    b1 = q.lastProgress["batchId"]
    cpu1 = cpu_seconds(runner)
    q.stop()
    return {"jobs_per_min": (b1 - b0) * 60.0 / seconds, "runner_cpu_percent": 100 * (cpu1 - cpu0) / seconds}
