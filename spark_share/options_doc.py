"""docs/options.md, generated from the option declarations (``python -m spark_share.options_doc > docs/options.md``).

Owns: the page's text: every option with its default, accepted values and meaning, the ``kafka.*``
rules (what is passed through, what is refused and why), and a runnable example. Must never: state an
option, a default or a bound of its own: everything comes from ``options``.
"""
from __future__ import annotations

from .options import CHECKED_KAFKA, DEFAULT_MAX_POLL_RECORDS, NOT_FOR_SHARE_GROUPS, OPTIONS, REJECTED_KAFKA

EXAMPLE = '''\
import os
import sys

from pyspark.sql import SparkSession

import spark_share

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
spark = SparkSession.builder.master("local[2]").getOrCreate()
spark_share.register(spark)

orders = (spark.readStream.format("kafka-share")
          .option("kafka.bootstrap.servers", os.environ["KAFKA_BOOTSTRAP_SERVERS"])
          .option("kafka.group.id", "orders")
          .option("subscribe", "orders")
          .option("includeHeaders", "true")
          .option("maxRecordsPerTrigger", "5000")
          .option("deadLetterPath", "/tmp/orders-dead-letters")
          .option("maxDeliveryCount", "3")
          .option("kafka.max.poll.records", "2000")
          .load())

q = spark_share.drain(orders.writeStream.format("parquet").option("path", "/tmp/orders")  # drain, then stop
                      .option("checkpointLocation", "/tmp/orders-ckpt"))
q.awaitTermination()
print(spark.read.parquet("/tmp/orders").count(), "records written")
'''


def _cell(markdown: str) -> str:
    return markdown.replace("|", "\\|")


def _plain(text: str) -> str:
    """Plain text (an error message's reason) as a table cell: '<group>' is no HTML tag."""
    return _cell(text.replace("<", "&lt;").replace(">", "&gt;"))


def options_markdown() -> str:
    """The text of docs/options.md, from the declarations in ``options``."""
    out = [
        "# Options of `format(\"kafka-share\")`",
        "",
        "<!-- Generated from spark_share/options.py by spark_share/options_doc.py: "
        "PYTHONPATH=. .venv/bin/python -m spark_share.options_doc > docs/options.md -->",
        "",
        "Give them with `.option(name, value)` on `spark.readStream.format(\"kafka-share\")`. Names are "
        "case-insensitive, as in Spark. An option the source does not know, a bad value, or an option it "
        "would not act on is refused when the source is created, with a `spark_share.OptionError` (a "
        "`ValueError`) that names the option and says what to do instead.",
        "",
        "| option | default | values | meaning |",
        "|---|---|---|---|",
    ]
    for o in OPTIONS:
        default = "required" if o.required else "none" if o.default is None else f"`{o.default}`"
        out.append(f"| `{o.name}` | {default} | {_cell(o.parser.accepts)} | {_cell(o.doc)} |")
    out += [
        "",
        "## `kafka.*`: passed to the share consumers",
        "",
        "Every other option that starts with `kafka.` goes, without the prefix, to the share consumers "
        "that read the records on the executors, e.g. `kafka.security.protocol`, "
        "`kafka.sasl.mechanism`, `kafka.sasl.username`, `kafka.sasl.password`, `kafka.ssl.*`, "
        "`kafka.fetch.max.bytes`. The source adds `share.acknowledgement.mode=explicit`: records are "
        "acknowledged only after Spark commits their batch.",
        "",
        "The driver's metadata client (topic-partitions and high watermarks) gets the same settings "
        "except the share consumer's own (`max.poll.records`, `share.*`); the producer that "
        "writes to `deadLetterTopic` gets the connection and security settings only.",
        "",
        f"`kafka.max.poll.records` ({CHECKED_KAFKA['max.poll.records'].accepts}) caps each poll. The source "
        "sizes polls itself, to each consumer's share of the lock budget (`maxRecordLocks`); with neither, "
        f"a poll takes up to {DEFAULT_MAX_POLL_RECORDS:,} records.",
        "",
        "Refused, because a share consumer does not take them or they are group configs set on the "
        "broker:",
        "",
        "| option | why |",
        "|---|---|",
    ]
    out += [f"| `kafka.{k}` | {_plain(why)} |" for k, why in REJECTED_KAFKA.items()]
    out += [
        "",
        "The record lock duration (`share.record.lock.duration.ms`, default 30 s), the delivery-count "
        "limit (`share.delivery.count.limit`, default 5) and where a new group starts "
        "(`share.auto.offset.reset`, default `latest`!) are **group configs set on the broker**, e.g. "
        "`kafka-configs.sh --alter --entity-type groups --entity-name orders --add-config "
        "share.auto.offset.reset=earliest`. (`spark-share broker` starts groups at `earliest`.)",
        "",
        "Secrets (any `kafka.*` option whose name says password, secret, token, credential, key or jaas: "
        "`kafka.sasl.password`, `kafka.ssl.key.password`, ...) never appear in offsets, logs, progress or "
        "error messages, and never cross a socket of ours: the executor-side agent gets the client "
        "configuration from the read task Spark ships to it.",
        "",
        "## Options of Spark's Kafka source",
        "",
        "They have no meaning for a share group; each is refused with what to do instead:",
        "",
        "| option | instead |",
        "|---|---|",
    ]
    out += [f"| `{k}` | {_plain(why)} |" for k, why in NOT_FOR_SHARE_GROUPS.items()]
    out += [
        "",
        "## Example",
        "",
        "With the embedded broker (`.venv/bin/spark-share broker --topic orders:4` prints "
        "`bootstrap.servers=127.0.0.1:PORT`; export that address as `KAFKA_BOOTSTRAP_SERVERS`, and "
        "produce some records with `.venv/bin/spark-share produce --bootstrap-servers "
        "$KAFKA_BOOTSTRAP_SERVERS --topic orders --count 10000`), this drains the queue into a Parquet "
        "table and stops:",
        "",
        "```python",
        EXAMPLE.rstrip("\n"),
        "```",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    print(options_markdown(), end="")
