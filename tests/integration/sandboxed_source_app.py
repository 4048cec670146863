"""A classic Spark application whose Python workers, the source's runner among them, run in mount namespaces
of their own with an empty /tmp, apart from this process, where foreachBatch runs: as a platform that
sandboxes user code apart from Spark's own processes would (test_sandboxed_source.py). The two share no
runtime directory: a query without ``exchangeLocation`` cannot take verdicts, and one with it drains
a topic with verdicts in foreachBatch, which learn the location from the batch's schema (``--exchange-in
schema``) or are given it with the rows collected to a list (``argument``: what Spark < 4.2 needs).
Prints one JSON line of what it saw.

    PYSPARK_PYTHON=WRAPPER python sandboxed_source_app.py --local-dir D --bootstrap B --topic T --group G \\
        --read-mode driver --exchange DIR --exchange-in schema --out DIR --checkpoint DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import spark_share
from spark_share.errors import VerdictError


def runner_namespaces() -> set[str]:
    """The mount namespaces of this machine's source runners (the trackers live there)."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"python_streaming_source_runner" in f.read():
                    found.add(os.readlink(f"/proc/{pid}/ns/mnt"))
        except OSError:
            continue
    return found


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    for name in ("--local-dir", "--bootstrap", "--topic", "--group", "--read-mode", "--exchange", "--out",
                 "--checkpoint"):
        ap.add_argument(name, required=True)
    ap.add_argument("--exchange-in", choices=("schema", "argument"), required=True)
    args = ap.parse_args(argv)
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (SparkSession.builder.master("local[2]").appName("sandboxed-source")
             .config("spark.local.dir", args.local_dir)
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2").getOrCreate())
    spark_share.register(spark)
    out, seen = args.out, {"mountNamespace": os.readlink("/proc/self/ns/mnt"), "runnerNamespaces": set()}
    given = {"exchange": None}  # the query's exchangeLocation, when foreachBatch is to name it

    def process(batch, batch_id):
        seen["runnerNamespaces"] |= runner_namespaces()
        rows = batch.withColumn("id", F.get_json_object(F.col("value").cast("string"), "$.id").cast("long"))
        tens = rows.where("id % 10 = 0")
        if given["exchange"] is not None:
            tens = tens.collect()  # a list of Rows carries no schema: the location comes as an argument
        # Before the write: a refusal writes nothing.
        spark_share.reject(tens, reason="tens", exchange_location=given["exchange"])
        rows.where("id % 10 != 0").drop("id").write.mode("append").parquet(out)

    def start(exchange: str | None, checkpoint: str):
        reader = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", args.bootstrap)
                  .option("kafka.group.id", args.group).option("subscribe", args.topic)
                  .option("readMode", args.read_mode).option("deadLetterPath", out + "-dlq"))
        if exchange is not None:
            reader = reader.option("exchangeLocation", exchange)
        return spark_share.drain(reader.load().writeStream.foreachBatch(process)
                                 .option("checkpointLocation", checkpoint))

    try:
        q = start(None, args.checkpoint + "-without")
        try:
            seen["withoutEnded"] = bool(q.awaitTermination(180))
        except StreamingQueryException:  # what it should do: the failure is read below
            seen["withoutEnded"] = True
        seen["withoutException"] = str(q.exception()) if q.exception() else None
        q.stop()
        given["exchange"] = args.exchange if args.exchange_in == "argument" else None
        q = start(args.exchange, args.checkpoint)
        seen["queryId"] = str(q.id)
        seen["ended"] = bool(q.awaitTermination(180))
        seen["exception"] = str(q.exception()) if q.exception() else None
        try:
            seen["status"] = spark_share.status(q)
        except VerdictError as e:
            seen["statusError"] = str(e)
        q.stop()
    finally:
        spark.stop()
        print("APP " + json.dumps(seen, default=sorted), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
