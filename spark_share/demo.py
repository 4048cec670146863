"""``spark-share demo``: a small end-to-end run on the embedded broker.

Starts EmbeddedKafka, produces JSON orders (a few malformed), drains the share group with
``format("kafka-share")`` and Trigger.AvailableNow into a Parquet table, rejects the malformed
rows, and prints what happened. Everything it starts, it stops.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time


def _produce(bootstrap: str, topic: str, n: int, malformed: float, partitions: int) -> int:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    rnd = random.Random(42)
    bad = 0
    for i in range(n):
        if rnd.random() < malformed:
            value = b"{not json"
            bad += 1
        else:
            value = json.dumps({"order_id": i, "customer": f"c{rnd.randrange(100)}",
                                "amount": round(rnd.uniform(1, 500), 2)}).encode()
        p.produce(topic, key=str(i).encode(), value=value, partition=i % partitions)
        p.poll(0)
    p.flush(30)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="spark-share demo", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000, help="orders to produce (default 20000)")
    ap.add_argument("--partitions", type=int, default=4, help="topic partitions (default 4)")
    ap.add_argument("--malformed", type=float, default=0.02, help="fraction of malformed records (default 0.02)")
    ap.add_argument("--out", default=None, help="output directory (default: a new temporary directory)")
    args = ap.parse_args(argv)

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession, functions as F

    import spark_share
    from spark_share.embedded import EmbeddedKafka

    out = args.out or tempfile.mkdtemp(prefix="spark-share-demo-")
    table, ckpt = os.path.join(out, "orders"), os.path.join(out, "checkpoint")
    shutil.rmtree(ckpt, ignore_errors=True)
    spark = (SparkSession.builder.master("local[2]").appName("spark-share-demo")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        spark_share.register(spark)
        with EmbeddedKafka() as kafka:
            kafka.create_topic("orders", args.partitions)
            t0 = time.time()
            bad = _produce(kafka.bootstrap_servers, "orders", args.records, args.malformed, args.partitions)
            print(f"produced {args.records} orders ({bad} malformed) to {kafka.bootstrap_servers} "
                  f"in {time.time() - t0:.1f} s")
            schema = "order_id long, customer string, amount double"
            counts = {"written": 0, "rejected": 0, "batches": 0}

            def process(batch, batch_id):
                parsed = batch.withColumn("order", F.from_json(F.col("value").cast("string"), schema,
                                                               {"mode": "PERMISSIVE"}))
                parsed = parsed.persist()
                good = parsed.where("order IS NOT NULL AND order.order_id IS NOT NULL").select("order.*", "offset")
                good.write.mode("append").parquet(table)
                counts["written"] += good.count()
                counts["rejected"] += spark_share.reject(
                    parsed.where("order IS NULL OR order.order_id IS NULL"), reason="unparseable JSON")
                counts["batches"] += 1
                parsed.unpersist()
                print(f"  batch {batch_id}: written {counts['written']}, rejected {counts['rejected']}", flush=True)

            stream = (spark.readStream.format("kafka-share")
                      .option("kafka.bootstrap.servers", kafka.bootstrap_servers)
                      .option("kafka.group.id", "demo-orders")
                      .option("subscribe", "orders")
                      .load())
            t1 = time.time()
            q = (stream.writeStream.foreachBatch(process).option("checkpointLocation", ckpt)
                 .trigger(availableNow=True).start())
            q.awaitTermination()
            wall = time.time() - t1
            total = counts["written"] + counts["rejected"]
            print(f"\nread {total} records in {counts['batches']} batches, {wall:.1f} s "
                  f"({total / wall if wall else 0:,.0f} records/s)")
            print(f"  written to {table}: {counts['written']}")
            print(f"  rejected (unparseable JSON): {counts['rejected']}")
            print(f"  missing: {args.records - total}")
        return 0 if total >= args.records else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
