"""Benchmarks: kafka-share against a raw share consumer, side by side, on one embedded broker.

    .venv/bin/python benchmarks/benchmark.py [--records 100000] [--repeats 3] [--out bench-out]
    .venv/bin/python benchmarks/benchmark.py --bootstrap-servers broker:9092 [--kafka-option K=V ...]   # your cluster

Prints a table and writes results.json and PNG plots to --out. Absolute numbers vary from run to
run on a shared 2-core machine; the ratios, measured in the same run, are what to compare.
Not part of the test run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # harness: the Kafka to run on, the resource sampler

from harness.kafka_cluster import EmbeddedCluster, ExternalCluster, cluster_options  # noqa: E402
from harness.resources import process_kind  # noqa: E402
from spark_share.embedded import EmbeddedKafka  # noqa: E402  (the repository, put on the path above)

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


def add_kafka_arguments(ap) -> None:
    """A benchmark's Kafka: the embedded broker, or ``--bootstrap-servers`` (a cluster of yours) with
    ``--kafka-option`` client configs (``cluster_options`` reads them)."""
    ap.add_argument("--bootstrap-servers", help="a Kafka >= 4.2 cluster of yours instead of the embedded broker")
    ap.add_argument("--kafka-option", action="append", default=[], metavar="K=V",
                    help="a client config for that cluster; repeatable; @FILE reads them from FILE")


def parse_args(ap, argv):
    """``ap``'s arguments (with ``add_kafka_arguments``'), the client configs as ``kafka_options``; ``out`` made."""
    args = ap.parse_args(argv)
    args.kafka_options = cluster_options(ap, args)
    os.makedirs(args.out, exist_ok=True)
    return args


def local_session():
    """The benchmarks' Spark: local[2], no UI, spark-share registered."""
    from pyspark.sql import SparkSession

    import spark_share

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_share.register(spark)
    return spark


def cluster(args):
    """A cluster of yours (tests/harness/kafka_cluster.py: topics and groups under a prefix of this run, deleted at the
    end; each share group set to start at the earliest record), or a fresh embedded broker."""
    if args.bootstrap_servers:
        return ExternalCluster(args.bootstrap_servers, args.kafka_options, prefix="spark-share-bench")
    return EmbeddedCluster()


def backlog(kafka, args, n: int, locks: int | None = None) -> str:
    """A topic of args.partitions partitions holding n records; on the embedded broker, its record
    locks set to ``locks`` (a cluster of yours keeps its own)."""
    if isinstance(kafka, EmbeddedKafka):
        kafka.set_max_record_locks(locks or args.max_record_locks)
    topic = kafka.create_topic("t", args.partitions)
    produce(kafka, topic, n, args.partitions)
    return topic


def produce(kafka, topic, n, partitions):
    from confluent_kafka import Producer

    from spark_share.job.workload import produce_waiting

    p = Producer({**kafka.client(), "linger.ms": 5, "batch.num.messages": 10000})
    payload = b"x" * 100
    for i in range(n):
        produce_waiting(p, topic, key=str(i).encode(), value=payload, partition=i % partitions)
    p.flush(60)


OURS = ("agent", "runner", "python workers")
BROKER = "this process (embedded broker, py4j)"


class CpuSampler:
    """CPU seconds of the processes of a run while it lasts: ours (agents, the runner, Python
    workers), and for context Spark's JVM and this process (the embedded broker's thread, py4j).
    Processes started during the run count from zero; the process list is read twice a second,
    CPU times five times a second (the sampler itself competes for the same 2 cores)."""

    def __init__(self):
        self.last = {}
        self.first = {}
        self.kind = {}
        self.procs = {}
        self._started = time.time()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    @staticmethod
    def ours(p):
        kind = process_kind(p)
        return {"driver": BROKER, "JVM": "JVM (Spark driver and executor)"}.get(kind, kind) if kind else None

    def _scan(self):
        for p in psutil.process_iter(["cmdline", "create_time"]):
            if p.pid in self.procs:
                continue
            try:
                kind = self.ours(p)
            except psutil.Error:
                continue
            if kind:
                self.procs[p.pid] = p
                self.kind[p.pid] = kind
                if p.info["create_time"] >= self._started:
                    self.first[p.pid] = 0.0

    def _loop(self):
        tick = 0
        while not self._stop.is_set():
            if tick % 3 == 0:
                self._scan()
            tick += 1
            for pid, p in list(self.procs.items()):
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    del self.procs[pid]
                    continue
                v = t.user + t.system
                self.first.setdefault(pid, v)
                self.last[pid] = v
            self._stop.wait(0.2)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    @property
    def seconds(self):
        """CPU seconds of spark-share's own processes (agents, the runner, Python workers)."""
        return sum(self.last[p] - self.first.get(p, 0) for p in self.last if self.kind[p] in OURS)

    @property
    def by_kind(self):
        out = {}
        for p in self.last:
            out[self.kind[p]] = out.get(self.kind[p], 0) + self.last[p] - self.first.get(p, 0)
        return out


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


def _batch_end(p) -> float:
    """Wall-clock time a progress event's batch ended."""
    from datetime import datetime

    started = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp()
    return started + p["durationMs"].get("triggerExecution", 0) / 1000.0


def share_stream(spark, kafka, topic, group=None, **options):
    """readStream.format("kafka-share") on ``kafka`` (its client options as kafka.*), the group set
    to start at the earliest record; readMode=executors, as the figures quoted from here were measured,
    unless ``readMode`` is given (benchmarks/read_modes.py compares the two)."""
    group = kafka.group(group or f"share-{uuid.uuid4().hex[:6]}")
    r = spark.readStream.format("kafka-share").option("kafka.group.id", group).option("subscribe", topic)
    for k, v in kafka.client().items():
        r = r.option("kafka." + k, v)
    for k, v in {"readMode": "executors", **options}.items():
        if v is not None:  # numPartitions=None: the source's default
            r = r.option(k, str(v))
    return r


def share_run(spark, kafka, topic, slots, n, tmp, locks=None, group=None, sink=None, **options):
    """An AvailableNow query over the backlog ``topic`` (``n`` records) into the noop sink (or
    ``sink``, a foreachBatch function), ``slots`` read tasks (None: the source's default), other source
    ``options`` as given: its times, CPU by process, Spark's per-batch phases and the tracker's view of
    each batch."""
    import spark_share

    r = share_stream(spark, kafka, topic, group=group, numPartitions=slots, **options)
    if locks and isinstance(kafka, EmbeddedKafka):
        r = r.option("maxRecordLocks", str(locks))
    df = r.load()
    with CpuSampler() as cpu:
        t0 = time.perf_counter()
        wall0 = time.time()
        w = df.writeStream.foreachBatch(sink) if sink else df.writeStream.format("noop")
        q = w.option("checkpointLocation", os.path.join(tmp, uuid.uuid4().hex)).trigger(availableNow=True).start()
        first = None  # (time, cpu) when the first batch (query, agent and consumer start-up) is done
        tracked, asked = {}, 0.0  # the tracker's summary of each batch (it keeps the last few)
        while not q.awaitTermination(0.1):
            if first is None and q.lastProgress:
                first = (time.perf_counter(), cpu.seconds, cpu.by_kind)
            if time.perf_counter() - asked > 0.5:
                asked = time.perf_counter()
                try:
                    tracked.update((b["batch"], b) for b in spark_share.status(q).get("batches", []))
                except Exception:  # not started yet, or just ended
                    pass
        end = time.perf_counter()
        wall_end = time.time()
        wall = end - t0
    if q.exception() is not None or sum(p["numInputRows"] for p in q.recentProgress) < n:
        raise RuntimeError(f"kafka-share read {sum(p['numInputRows'] for p in q.recentProgress):,} of the {n:,} "
                           f"records of the backlog (query exception: {q.exception()})")
    prog = [p for p in q.recentProgress if p["numInputRows"]]
    # Query start -> its first batch with rows written; that batch's end -> the run's end.
    first_row_s = _batch_end(prog[0]) - wall0 if prog else None
    end_after_last_s = wall_end - _batch_end(prog[-1]) if prog else None
    rows = sum(p["numInputRows"] for p in prog)
    busy = sum(p["durationMs"]["triggerExecution"] for p in prog) / 1000.0
    after_first = rows - (prog[0]["numInputRows"] if prog else 0)
    first = first or (t0, 0.0, {})
    phases = spark_phases(q)
    return {"seconds": wall, "busy_seconds": busy, "records": rows, "batches": len(prog), "cpu": cpu.seconds,
            "tracked": [tracked[k] for k in sorted(tracked)],
            "first_row_s": first_row_s, "end_after_last_s": end_after_last_s,
            "mean_batch": rows / max(1, len(prog)),
            "phases": phases,
            "cpu_by_process": cpu.by_kind, "steady_records": after_first,
            "steady_seconds": end - first[0], "steady_cpu": cpu.seconds - first[1],
            "steady_cpu_by_process": {k: round(v - first[2].get(k, 0.0), 2) for k, v in cpu.by_kind.items()},
            "steady_cpu_per_m_by_process": {k: (v - first[2].get(k, 0.0)) / max(after_first, 1) * 1e6
                                            for k, v in cpu.by_kind.items()}}


def startup_bench(spark, args, tmp, runs=5, records=100):
    """Query start -> the first rows in foreachBatch (counted there), on a fresh topic of ``records``
    in a warm Spark session: what a scheduled job waits before its data arrives (the agent's start,
    the group join and the first poll), apart from the time a big first batch takes."""
    firsts, ends = [], []
    for run in range(runs):
        with cluster(args) as kafka:
            topic = backlog(kafka, args, records)
            seen: dict[str, float] = {}

            def first_rows(df, _batch_id):
                if df.count() and "rows" not in seen:
                    seen["rows"] = time.perf_counter()

            t0 = time.perf_counter()
            q = (share_stream(spark, kafka, topic, numPartitions=2).load().writeStream.foreachBatch(first_rows)
                 .option("checkpointLocation", os.path.join(tmp, uuid.uuid4().hex)).trigger(availableNow=True).start())
            q.awaitTermination(300)
            if "rows" in seen:
                firsts.append(seen["rows"] - t0)
                ends.append(time.perf_counter() - seen["rows"])
    out = {"runs": runs, "records": records, "first_rows_s": firsts, "end_after_rows_s": ends}
    print("startup:", json.dumps({k: [round(x, 2) for x in v] if isinstance(v, list) else v for k, v in out.items()}),
          flush=True)
    return out


def batch_size_sweep(spark, args, tmp, slots=2):
    """records/s against batch size: the lock budget (partitions x record locks) sets the size of a
    backlog's batches; Spark's floor runs batches of the same size next to it."""
    rows = []
    for size in (5_000, 10_000, 20_000, 40_000, 80_000):
        locks = max(1, size // args.partitions)
        n = max(args.records, 3 * size)
        with EmbeddedCluster() as kafka:
            ours = share_run(spark, kafka, backlog(kafka, args, n, locks), slots, n, tmp, locks=locks)
        full = [p for p in ours["phases"] if p["rows"]]
        floor = floor_run(spark, len(full), slots, max(1, n // max(1, len(full)) // slots), tmp)
        row = {"budget": locks * args.partitions, "mean_batch": ours["mean_batch"],
               "share_steady_rps": ours["steady_records"] / max(ours["steady_seconds"], 1e-9),
               "floor_steady_rps": floor["steady_rps"], "first_row_s": ours["first_row_s"]}
        print("batchsize", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
              flush=True)
        rows.append(row)
    return rows


def floor_run(spark, batches, tasks, rows, tmp):
    """Spark's own cost for a Python streaming source that does no work (benchmarks/bench_floor.py)."""
    with CpuSampler() as cpu:
        t0 = time.perf_counter()
        q = (spark.readStream.format("spark-share-floor").option("batches", batches).option("tasks", tasks)
             .option("rows", rows).load().writeStream.format("noop")
             .option("checkpointLocation", os.path.join(tmp, uuid.uuid4().hex)).trigger(availableNow=True).start())
        first = None
        while not q.awaitTermination(0.1):
            if first is None and q.lastProgress:
                first = (time.perf_counter(), cpu.seconds, cpu.by_kind)
        end = time.perf_counter()
    records = sum(p["numInputRows"] for p in q.recentProgress)
    first = first or (t0, 0.0, {})
    steady = records - tasks * rows
    phases = spark_phases(q)
    return {"records": records, "rps": records / (end - t0), "steady_rps": steady / (end - first[0]),
            "phases": phases,
            "cpu_per_m": cpu.seconds / records * 1e6, "steady_cpu_per_m": (cpu.seconds - first[1]) / steady * 1e6,
            "cpu_by_process": {k: round(v, 2) for k, v in cpu.by_kind.items()},
            "steady_cpu_per_m_by_process": {k: (v - first[2].get(k, 0.0)) / steady * 1e6 for k, v in cpu.by_kind.items()}}


def decode_bench(n=300_000, repeats=5):
    """Messages -> Arrow on one core, as the agent converts a poll (one subscribed topic; a fetch
    returns each partition's records as one stretch), against per-message Python tuples."""
    import pyarrow as pa
    from confluent_kafka import Message

    from spark_share.consumers import records

    msgs = [Message(topic="orders", partition=p, offset=o, key=str(o).encode(), value=b"x" * 100,
                    timestamp=(1, 1_700_000_000_000 + o), delivery_count=1) for p in range(4) for o in range(n // 4)]
    records.warm_up()

    def naive(ms):  # per-message Python tuples, then columns
        rows = [(m.key(), m.value(), m.topic(), m.partition(), m.offset(), m.timestamp()[1] * 1000,
                 m.timestamp()[0] - 1, m.delivery_count()) for m in ms]
        cols = list(zip(*rows))
        types = [pa.binary(), pa.binary(), pa.string(), pa.int32(), pa.int64(), pa.timestamp("us", tz="UTC"),
                 pa.int32(), pa.int32()]
        return pa.RecordBatch.from_arrays([pa.array(c, t) for c, t in zip(cols, types)],
                                          schema=records.ARROW_SCHEMA)

    def best(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(msgs)
            times.append(time.perf_counter() - t0)
        return n / min(times)

    return {"ours_rows_per_s": best(lambda m: records.to_record_batch(m, False, topic="orders")),
            "naive_rows_per_s": best(naive)}


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
    df = share_stream(spark, kafka, kafka.create_topic("idle", 2)).load()
    q = df.writeStream.format("noop").option("checkpointLocation", tempfile.mkdtemp(prefix="bench-idle-")).start()
    time.sleep(10)  # past the first (probe) batch
    runner = [p for p in psutil.process_iter(["cmdline"])
              if any("python_streaming_source_runner" in c for c in (p.info["cmdline"] or []))]
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in runner)
    b0 = q.lastProgress["batchId"] if q.lastProgress else 0
    time.sleep(seconds)
    b1 = q.lastProgress["batchId"]
    cpu1 = sum(sum(p.cpu_times()[:2]) for p in runner)
    q.stop()
    return {"jobs_per_min": (b1 - b0) * 60.0 / seconds, "runner_cpu_percent": 100 * (cpu1 - cpu0) / seconds}


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--max-record-locks", type=int, default=2000,
                    help="the broker's per-partition in-flight limit (Kafka's group.share.partition.max.record.locks)")
    ap.add_argument("--bootstrap-servers", help="a Kafka >= 4.2 cluster of yours instead of the embedded broker "
                    "(topics are created with unique names and deleted; needs create/delete topic and alter group "
                    "config permissions)")
    ap.add_argument("--kafka-option", action="append", default=[], metavar="K=V",
                    help="a client config for that cluster (security.protocol=SASL_SSL, ...); repeatable; "
                    "@FILE reads them from FILE, one per line (keeps credentials off the command line)")
    ap.add_argument("--skip", default="",
                    help="comma-separated sections to skip: throughput,ceiling,scaling,startup,batchsize,latency,idle,decode")
    args = ap.parse_args(argv)
    args.kafka_options = cluster_options(ap, args)  # errors name an option by its position: it may be a credential
    skip = set(filter(None, args.skip.split(",")))
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    # Spark's Python processes (planning workers, the source runner) must import benchmarks/bench_floor.py.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)),
                                                              os.environ.get("PYTHONPATH")]))
    from pyspark.sql import SparkSession

    import spark_share

    results = {"machine": {"cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30)},
               "records": args.records, "partitions": args.partitions,
               "max_record_locks": None if args.bootstrap_servers else args.max_record_locks,
               "cluster": "yours" if args.bootstrap_servers else "embedded"}
    if "decode" not in skip:
        results["decode"] = decode_bench()
        print("decode:", json.dumps(results["decode"]))
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_share.register(spark)
    from bench_floor import FloorSource

    spark.dataSource.register(FloorSource)
    tmp = tempfile.mkdtemp(prefix="bench-")
    try:
        # Warm-up, not measured: Spark's first query pays JIT compilation and the start of its Python
        # planning workers (each imports pyspark); a scheduled job pays that too, a stream once.
        with cluster(args) as kafka:
            share_run(spark, kafka, backlog(kafka, args, 20_000), 2, 20_000, tmp)
        if "ceiling" not in skip:
            # The broker's own ceiling: a raw loop with one consumer per partition.
            with cluster(args) as kafka:
                raw = raw_loop(kafka, backlog(kafka, args, args.records), args.partitions, args.records)
            results["ceiling"] = {"consumers": args.partitions, "records_per_s": raw["records"] / raw["seconds"]}
            print("ceiling:", json.dumps(results["ceiling"]), flush=True)
        for section, slot_list in (("throughput", [2]), ("scaling", [1, 2, 4])):
            if section in skip:
                continue
            rows = []
            for slots in slot_list:
                for rep in range(args.repeats if section == "throughput" else 1):
                    with cluster(args) as kafka:
                        topic = backlog(kafka, args, args.records)
                        with CpuSampler() as broker:
                            raw = raw_loop(kafka, topic, slots, args.records)
                    with cluster(args) as kafka:
                        ours = share_run(spark, kafka, backlog(kafka, args, args.records), slots, args.records, tmp,
                                         locks=args.max_record_locks)
                    # Spark's floor with the same shape: as many batches and tasks, as many rows per task.
                    full = [p for p in ours["phases"] if p["rows"]]
                    floor = floor_run(spark, len(full), slots, max(1, args.records // max(1, len(full)) // slots), tmp)
                    row = {"slots": slots, "raw_rps": raw["records"] / raw["seconds"],
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
                    print(section, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
                          flush=True)
                    rows.append(row)
            results[section] = rows
        if "startup" not in skip:
            results["startup"] = startup_bench(spark, args, tmp)
        if "batchsize" not in skip:
            if args.bootstrap_servers:
                print("batchsize: skipped on a cluster of yours (it sets the broker's record locks)")
            else:
                results["batchsize"] = batch_size_sweep(spark, args, tmp)
        if "latency" not in skip:
            with cluster(args) as kafka:
                results["latency"] = latency_bench(spark, kafka)
            print("latency:", json.dumps(results["latency"]))
        if "idle" not in skip:
            with cluster(args) as kafka:
                results["idle"] = idle_bench(spark, kafka)
            print("idle:", json.dumps(results["idle"]))
    finally:
        spark.stop()
    report(results, args.out)
    return 0


def report(results, out):
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    after = []
    print("\n| measure | kafka-share | raw share consumer | ratio | target |")
    print("|---|---|---|---|---|")
    t = results.get("throughput")
    if t:
        share = statistics.median(r["share_rps"] for r in t)
        busy = statistics.median(r["share_busy_rps"] for r in t)
        raw = statistics.median(r["raw_rps"] for r in t)
        print(f"| throughput, records/s (wall, incl. query start) | {share:,.0f} | {raw:,.0f} | {share / raw:.2f} | >= 0.90 |")
        print(f"| throughput, records/s (inside batches) | {busy:,.0f} | {raw:,.0f} | {busy / raw:.2f} | >= 0.90 |")
        steady = statistics.median(r["share_steady_rps"] for r in t)
        print(f"| throughput, records/s (after the first batch) | {steady:,.0f} | {raw:,.0f} | {steady / raw:.2f} | >= 0.90 |")
        sc = statistics.median(r["share_cpu_per_m"] for r in t)
        rc = statistics.median(r["raw_cpu_per_m"] for r in t)
        print(f"| CPU s per million records (whole run) | {sc:,.1f} | {rc:,.1f} | {sc / rc:.2f} | <= 1.5 |")
        ss = statistics.median(r["share_steady_cpu_per_m"] for r in t)
        print(f"| CPU s per million records (after the first batch) | {ss:,.1f} | {rc:,.1f} | {ss / rc:.2f} | <= 1.5 |")
        fc = statistics.median(r["floor_steady_cpu_per_m"] for r in t)
        print(f"| (context) Spark's floor: a Python source yielding prebuilt batches, same shape, CPU s per million "
              f"records after the first batch | {fc:,.1f} | | | |")
        print(f"| CPU s per million records above Spark's floor, after the first batch | {ss - fc:,.1f} | {rc:,.1f} "
              f"| {(ss - fc) / rc:.2f} | <= 1.0 |")
        if all("steady_cpu_per_m_by_process" in r for r in t):
            def by_process(key):
                return ", ".join(f"{k} {statistics.median(r[key].get(k, 0.0) for r in t):.1f}" for k in OURS
                                 if any(k in r[key] for r in t))
            print(f"| CPU s per million records after the first batch, by process | {by_process('steady_cpu_per_m_by_process')}"
                  f" | {rc:,.1f} (one process) | | |")
            print(f"| (context) Spark's floor, the same, by process | {by_process('floor_steady_cpu_per_m_by_process')}"
                  " | | | |")
        fr = statistics.median(r["floor_steady_rps"] for r in t)
        print(f"| (context) Spark's floor, records/s after the first batch | {fr:,.0f} | | | |")
        fr_s = statistics.median(r["first_row_s"] for r in t)
        print(f"| (context) query start -> end of the backlog's first batch, s | {fr_s:.1f} | | | |")
        ea = statistics.median(r["end_after_last_s"] for r in t)
        print(f"| AvailableNow: last batch with rows -> query end, s | {ea:.1f} | | | <= 2 |")
        mb = statistics.median(r["mean_batch"] for r in t)
        if results.get("max_record_locks"):
            budget = results["partitions"] * results["max_record_locks"]
            print(f"| mean batch, records (lock budget {budget:,}) | {mb:,.0f} | | {mb / budget:.2f} | |")
        else:
            print(f"| mean batch, records (lock budget: the broker's) | {mb:,.0f} | | | |")
        sb = statistics.median(r["share_broker_cpu_per_m"] for r in t)
        rb = statistics.median(r["raw_broker_cpu_per_m"] for r in t)
        print(f"| (context) embedded broker process, CPU s per million records | {sb:,.1f} | {rb:,.1f} | {sb / rb:.2f} | |")
        full = [p for r in t for p in r["phases"][1:] if p["rows"] >= 0.5 * max(q["rows"] for q in r["phases"])]
        if full:
            keys = [k for k in full[0] if k not in ("batch", "rows")]
            after.append("full batches after the first, median ms: " + ", ".join(
                f"{k} {statistics.median(p[k] for p in full):.0f}" for k in keys)
                + f" (rows {statistics.median(p['rows'] for p in full):.0f})")
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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots; pip install 'spark-share[bench]')")
        return
    def lines(name, rows, x, series, xlabel, title, log=False):
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
        fig.tight_layout()
        fig.savefig(os.path.join(out, name))

    if results.get("scaling"):
        lines("throughput.png", results["scaling"], "slots",
              [("raw_rps", "o-", "raw ShareConsumer loop"), ("share_rps", "o-", "kafka-share -> noop (wall)"),
               ("share_steady_rps", "o--", "kafka-share (after the first batch)")],
              "consumers (numPartitions)", "Throughput on the embedded broker")
    if results.get("throughput"):
        fig, ax = plt.subplots(figsize=(6, 4))
        t = results["throughput"]
        ax.bar(["raw loop", "kafka-share\n(whole run)", "kafka-share\n(after 1st batch)",
                "Spark's floor\n(after 1st batch)"],
               [statistics.median(r["raw_cpu_per_m"] for r in t), statistics.median(r["share_cpu_per_m"] for r in t),
                statistics.median(r["share_steady_cpu_per_m"] for r in t),
                statistics.median(r["floor_steady_cpu_per_m"] for r in t)])
        ax.set_ylabel("CPU seconds per million records")
        ax.set_title("CPU cost (agents, runner, Python workers; not the JVM)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "cpu.png"))
    if results.get("batchsize"):
        lines("batch-size.png", results["batchsize"], "mean_batch",
              [("share_steady_rps", "o-", "kafka-share (after the first batch)"),
               ("floor_steady_rps", "o--", "Spark's floor, same batches")],
              "records per batch (set by the lock budget)", "Throughput against batch size, embedded broker", log=True)


if __name__ == "__main__":
    sys.exit(main())
