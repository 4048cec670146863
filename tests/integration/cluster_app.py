"""The driver program of the cluster tests: runs on the driver host of a NamespaceCluster, reads a
topic with kafka-share, and writes what it saw to ``<shared>/result.json`` (the test's process
cannot share a SparkContext with it).

    python cluster_app.py drain  --master URL --driver-host IP --bootstrap B --topic T --group G --shared DIR
    python cluster_app.py stream ... (processingTime; stops when <shared>/stop exists)

Every batch does two actions (a count, then the write), without persist: the second reads the batch
again, possibly on another host. While the query runs, a thread samples ``status()``: agents,
consumers (share sessions) per host, the most that held records at once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import spark_share


def _shortened(text: str) -> str:
    """An error's head (Spark's summary) and tail (the Python exception that caused it), within 5,000 characters."""
    return text if len(text) <= 5000 else text[:1500] + "\n...\n" + text[-3500:]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["drain", "stream"])
    ap.add_argument("--master", required=True)
    ap.add_argument("--driver-host", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--shared", required=True)
    ap.add_argument("--partitions", default="8")
    ap.add_argument("--cores-max", default="3")
    ap.add_argument("--max-per-trigger", default=None)
    ap.add_argument("--conf", action="append", default=[], help="extra Spark conf key=value")
    ap.add_argument("--option", action="append", default=[],
                    help="extra kafka-share option key=value (readMode=executors unless given: the cluster tests test agents)")
    ap.add_argument("--slow-first-attempt", type=float, default=0.0,
                    help="the first attempt to see a row in each batch's count sleeps this long (speculation)")
    ap.add_argument("--fail-first-attempt", type=int, default=None, metavar="BATCH",
                    help="the first attempt to see a row in this batch's count fails (a task retry)")
    ap.add_argument("--await-executor-removal-after", type=int, default=None, metavar="BATCH",
                    help="after writing this batch, wait (at most 60 s) until dynamic allocation removed an executor")
    ap.add_argument("--run", type=int, default=0, help="the run's number in its rows (a query restarted elsewhere)")
    ap.add_argument("--crash-after-write", type=int, default=None, metavar="BATCH",
                    help="foreachBatch raises after writing this batch, once; the query restarts from its checkpoint")
    args = ap.parse_args(argv)

    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(args.master).appName("spark-share-cluster-test")
               .config("spark.driver.host", args.driver_host).config("spark.driver.bindAddress", args.driver_host)
               .config("spark.executor.cores", "1").config("spark.executor.memory", "640m")
               .config("spark.cores.max", args.cores_max).config("spark.ui.enabled", "false")
               .config("spark.task.maxFailures", "4").config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.streaming.stopTimeout", "60s"))
    for kv in args.conf:
        k, v = kv.split("=", 1)
        builder = builder.config(k, v)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    spark_share.register(spark)
    out = os.path.join(args.shared, "out")
    batches: list[dict] = []

    def executors() -> int:
        """Executors the application has now (its block managers, the driver's aside): dynamic allocation
        removes and adds them."""
        try:
            return int(spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size()) - 1
        except Exception:  # the context is stopping
            return -1

    seen_path = os.path.join(args.shared, "batches.jsonl")

    shared = args.shared
    slow_s = args.slow_first_attempt
    run = {"n": args.run}  # query runs: a crash after the write restarts the query

    def attempt_marker(fail: bool):
        def keep(value) -> bool:
            """Keeps every row. Leaves <shared>/attempts/<stage>-<partition>-<attempt> holding the host's
            name (every host sees <shared>). The first attempt to see a row in each stage is slow, so
            that Spark launches a speculative copy, or fails, so that Spark retries it. (Not a fixed
            partition: a read task may have no rows, and then it never calls this.)"""
            import socket

            from pyspark import TaskContext

            tc = TaskContext.get()
            mark = os.path.join(shared, "attempts", f"{tc.stageId()}-{tc.partitionId()}-{tc.attemptNumber()}")
            if not os.path.exists(mark):
                os.makedirs(os.path.dirname(mark), exist_ok=True)
                with open(mark, "w") as f:
                    f.write(socket.gethostname())
                if tc.attemptNumber() == 0 and _first_in_stage(tc.stageId()):
                    if fail:
                        raise RuntimeError("the first attempt of this task fails (cluster test)")
                    time.sleep(slow_s)
            return True
        return keep

    def _first_in_stage(stage: int) -> bool:
        """True for one caller per stage, across hosts (O_EXCL on the shared directory)."""
        os.makedirs(os.path.join(shared, "first"), exist_ok=True)
        try:
            os.close(os.open(os.path.join(shared, "first", str(stage)), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def process(batch, batch_id):
        from pyspark.sql import functions as F

        fail = batch_id == args.fail_first_attempt
        if slow_s or fail:
            # A filter, so that the optimizer cannot drop the UDF from the count.
            keep = F.udf(attempt_marker(fail), "boolean")
            n = batch.where(keep("value")).count()  # first action, one task slow or failing at first
        else:
            n = batch.count()  # first action
        (batch.select("key", "value", "topic", "partition", "offset", "deliveryCount")
         .withColumn("batch", F.lit(batch_id)).withColumn("run", F.lit(run["n"]))
         .withColumn("task", F.spark_partition_id())
         .write.mode("append").parquet(out))  # second action: the batch is read again, maybe on another host
        crashed = os.path.join(shared, "crashed")
        if batch_id == args.crash_after_write and not os.path.exists(crashed):
            open(crashed, "w").close()
            raise RuntimeError(f"foreachBatch fails after writing batch {batch_id} (cluster test)")
        seen = {"batch": batch_id, "count": n, "t": time.time(), "run": run["n"]}
        if batch_id == args.await_executor_removal_after and not run.get("awaited_removal"):
            run["awaited_removal"] = True
            before, deadline = executors(), time.monotonic() + 60
            while executors() >= before and time.monotonic() < deadline:
                time.sleep(0.2)  # a bounded wait until the idle executors are removed
            seen.update(executorsBefore=before, executorsAfter=executors())
        batches.append(seen)
        with open(seen_path, "a") as f:  # the test follows the stream here
            f.write(json.dumps(batches[-1]) + "\n")

    def start_query():
        w = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", args.bootstrap)
             .option("kafka.group.id", args.group).option("subscribe", args.topic)
             .option("numPartitions", args.partitions)
             .options(**({"maxRecordsPerTrigger": args.max_per_trigger} if args.max_per_trigger else {}))
             .options(**{"readMode": "executors", **dict(o.split("=", 1) for o in args.option)}).load()
             .writeStream.foreachBatch(process).option("checkpointLocation", os.path.join(args.shared, "ck")))
        return (w.trigger(availableNow=True) if args.mode == "drain" else w.trigger(processingTime="1 second")).start()

    queries = [start_query()]

    samples: list[dict] = []
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            try:
                st = spark_share.status(queries[-1])
            except Exception as e:  # the query ended between two samples
                samples.append({"error": str(e)[:200]})
                continue
            samples.append({"t": time.time(), "agents": st["agents"], "hosts": st.get("hosts"),
                            "expired": st["expired"], "batch": st["batch"], "relayed": st.get("relayed"),
                            "acquired": {b.get("sparkBatch", b["batch"]): b["acquired"] for b in st["batches"]},
                            "members": st.get("members"), "memberLimit": st.get("memberLimit"),
                            "membersRefused": st.get("membersRefused"), "executors": executors()})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ready = os.path.join(args.shared, "running")
    open(ready, "w").close()
    error = None
    q = queries[0]
    try:
        if args.mode == "drain":
            while True:
                try:
                    queries[-1].awaitTermination(600)
                except Exception:  # the query failed: judged below
                    pass
                if queries[-1].exception() is None or args.crash_after_write is None or run["n"] > args.run:
                    break
                run["n"] += 1  # the crash after the write: a new run of the query, from its checkpoint
                queries.append(start_query())
            q = queries[-1]
        else:
            q = queries[-1]
            stop = os.path.join(args.shared, "stop")
            while not os.path.exists(stop) and q.isActive:
                q.awaitTermination(0.5)
        final = spark_share.status(q) if q.isActive else None
        q.stop()
        if q.exception() is not None:
            error = _shortened(str(q.exception()))
    except Exception as e:
        error = _shortened(str(e))
        final = None
    done.set()
    sampler.join()
    result = {"batches": batches, "samples": samples, "final": final, "error": error,
              "lastProgress": json.loads(q.lastProgress.json) if q.lastProgress else None}
    with open(os.path.join(args.shared, "result.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(args.shared, "result.json.tmp"), os.path.join(args.shared, "result.json"))
    spark.stop()
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
