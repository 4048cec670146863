"""A Spark driver program whose whole process group a test kills with SIGKILL at one point of one batch
(test_driver_killed.py): a lost driver, as a node's loss or an OOM kill ends it, with its JVM, the source's
runner and the Python workers.

    python killed_driver_app.py CONFIG_JSON

Its first line on stdin holds the source's ``kafka.*`` options as JSON (secrets stay off the command line).
CONFIG_JSON: ``checkpoint``, ``out`` (the sink's directory), ``sink`` (``batch_dirs``: a foreachBatch that
writes ``out/batch_id=N/`` once and skips a batch id it has, as Delta's txnVersion does; ``parquet``: Spark's
file sink), ``group``, ``topic``, ``maxRecordsPerTrigger``, ``kill`` (``after_sink_write``: in foreachBatch
right after batch ``batch``'s write, before Spark's commit log; ``after_commit_log``: in a listener that runs
before spark-share's, as batch ``batch``'s progress is posted, which is after its commit log and before any
acknowledgement; ``none``: drain to the end and print ``PROGRESS <the progress reports as JSON>``).

With ``kill`` set, the program never returns: ``KILLING <batch>`` is its last line. Each batch id the
foreachBatch sink is handed is noted under ``out/_handed/`` with the ids it carried, also when the sink skips
it, so the test can compare a replayed batch with the one written first.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time


def _kill_everything(batch_id: int) -> None:
    sys.stdout.write(f"KILLING {batch_id}\n")
    sys.stdout.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the test started us in a process group of our own


def _ids(df) -> list[int]:
    from pyspark.sql import functions as F

    return [r[0] for r in df.select(F.get_json_object(F.col("value").cast("string"), "$.id").cast("long"))
            .collect()]


def main() -> None:
    conf = json.loads(sys.argv[1])
    client = json.loads(sys.stdin.readline())
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQueryListener

    spark = (SparkSession.builder.master("local[2]").appName("killed-driver")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    kill, kill_batch, out = conf["kill"], conf.get("batch", -1), conf["out"]

    class KillAfterCommitLog(StreamingQueryListener):
        """Added before register()'s listener: the bus calls listeners in order, so spark-share's never
        hears of this batch's commit, and Spark's next batch (the source's commit()) waits for a trigger
        that comes after this program's end."""

        def onQueryStarted(self, event):
            pass

        def onQueryProgress(self, event):
            if event.progress.batchId == kill_batch:
                _kill_everything(kill_batch)

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            pass

    if kill == "after_commit_log":
        spark.streams.addListener(KillAfterCommitLog())
    import spark_share

    spark_share.register(spark)
    reader = (spark.readStream.format("kafka-share").options(**client)
              .option("kafka.group.id", conf["group"]).option("subscribe", conf["topic"])
              .option("maxRecordsPerTrigger", str(conf["maxRecordsPerTrigger"])).load())

    def write_once(df, batch_id):
        ids = _ids(df)
        handed = os.path.join(out, "_handed")
        os.makedirs(handed, exist_ok=True)
        with open(os.path.join(handed, f"{batch_id}-{os.getpid()}.json"), "w") as f:
            json.dump(ids, f)
        final = os.path.join(out, f"batch_id={batch_id}")
        if not os.path.exists(final):  # a batch id written before is skipped: the sink is idempotent
            tmp = final + ".tmp"
            os.makedirs(tmp, exist_ok=True)
            with open(os.path.join(tmp, "ids.json"), "w") as f:
                json.dump(ids, f)
            os.rename(tmp, final)
        if kill == "after_sink_write" and batch_id == kill_batch:
            _kill_everything(batch_id)

    if conf["sink"] == "batch_dirs":
        writer = reader.writeStream.foreachBatch(write_once)
    else:
        writer = reader.selectExpr("topic", "partition", "offset", "value").writeStream.format("parquet") \
            .option("path", out)
    writer = writer.option("checkpointLocation", conf["checkpoint"])
    if kill == "none":
        query = spark_share.drain(writer)
        query.awaitTermination()
        assert query.exception() is None, query.exception()
        sys.stdout.write("PROGRESS " + json.dumps([json.loads(p.json) for p in query.recentProgress]) + "\n")
    else:
        # Batches back to back until the kill, except after the batch killed after its commit log: nothing may
        # plan the next one (that acknowledges it) before the listener kills. Spark starts a processing-time
        # trigger at multiples of its interval since the epoch: an interval of the seconds since the epoch puts
        # the next one decades away (a 60 s interval let a batch that crossed a minute's end be followed at once).
        interval = f"{int(time.time()) - 1} seconds" if kill == "after_commit_log" else "0 seconds"
        query = writer.trigger(processingTime=interval).start()
        query.awaitTermination(600)
        sys.stdout.write("NOT KILLED\n")
    sys.stdout.flush()
    spark.stop()


if __name__ == "__main__":
    main()
