"""A Spark Connect client program for the test of a client that shares no file system view with the
server (test_connect.py): it runs in a mount namespace of its own with an empty /tmp, as a notebook's
process does in Databricks' sandbox, drains a topic with verdicts in foreachBatch, then asks
``status()``, and prints one JSON line of what it saw.

    python connect_client_app.py --remote sc://127.0.0.1:PORT --bootstrap B --topic T --group G \\
        --read-mode driver --out DIR --checkpoint DIR

``--out`` and ``--checkpoint`` are paths of the server's view (foreachBatch and the query run there);
this process never reads them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import spark_share
from spark_share.errors import VerdictError


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--remote", "--bootstrap", "--topic", "--group", "--read-mode", "--out", "--checkpoint"):
        ap.add_argument(name, required=True)
    args = ap.parse_args(argv)
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    spark = ConnectSession.builder.remote(args.remote).create()
    spark_share.register(spark)
    out = args.out

    def process(batch, batch_id):
        from pyspark.sql import functions as F

        import spark_share

        rows = batch.withColumn("id", F.get_json_object(F.col("value").cast("string"), "$.id").cast("long"))
        spark_share.reject(rows.where("id % 10 = 0"), reason="tens")
        rows.where("id % 10 != 0").drop("id").write.mode("append").parquet(out)

    df = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", args.bootstrap)
          .option("kafka.group.id", args.group).option("subscribe", args.topic)
          .option("readMode", args.read_mode).option("deadLetterPath", out + "-dlq").load())
    q = spark_share.drain(df.writeStream.foreachBatch(process).option("checkpointLocation", args.checkpoint))
    seen: dict = {"queryId": str(q.id), "mountNamespace": os.readlink("/proc/self/ns/mnt"),
                  "tmp": sorted(os.listdir("/tmp"))}
    try:
        seen["ended"] = bool(q.awaitTermination(180))
        failure = q.exception()
        seen["exception"] = str(failure) if failure else None
        try:
            seen["status"] = spark_share.status(q)
        except VerdictError as e:
            seen["statusError"] = str(e)
    finally:
        q.stop()
        spark.stop()
    print("CLIENT " + json.dumps(seen, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
