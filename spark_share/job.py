"""The scheduled job: drain a share group into a Parquet table, set bad records aside, stop.

Owns: the job's config (JSON; credentials from the environment or a Databricks secret scope,
never from the file), the per-batch logic (parse JSON against a schema, validate, append valid
rows partitioned by date, reject invalid rows with a reason to the dead-letter table, release
rows that hit a transient condition) and the summary it prints. ``jobs/queue_to_table.py`` is the
file people run; with no ``--config`` it runs on the embedded broker with a synthetic workload.

Must never: hold credentials in a config file or print them, or accept a row before its batch
has committed (it only names verdicts; the source acknowledges).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional


class ConfigError(ValueError):
    """A bad job config; the message names the field."""


@dataclass
class JobConfig:
    bootstrap_servers: str
    group_id: str
    topics: List[str]
    schema: str
    output_path: str
    dead_letter_path: str
    checkpoint_path: str
    required: List[str] = field(default_factory=list)
    release_if: Optional[str] = None
    partition_by: str = "event_date"
    trigger: str = "availableNow"
    source_options: Dict[str, str] = field(default_factory=dict)
    spark_master: Optional[str] = None


_REF = re.compile(r"\$\{(env|secret):([^}]+)\}")


def _resolve(value: str, where: str) -> str:
    """``${env:NAME}`` from the environment, ``${secret:scope/key}`` from a Databricks secret scope."""
    def sub(m):
        kind, ref = m.group(1), m.group(2)
        if kind == "env":
            if ref not in os.environ:
                raise ConfigError(f"{where}: environment variable {ref} is not set")
            return os.environ[ref]
        scope, _, key = ref.partition("/")
        try:
            from pyspark.dbutils import DBUtils  # Databricks only
            from pyspark.sql import SparkSession

            return DBUtils(SparkSession.getActiveSession()).secrets.get(scope=scope, key=key)
        except ImportError:
            raise ConfigError(f"{where}: ${{secret:{ref}}} needs Databricks secret scopes; use ${{env:NAME}} "
                              "elsewhere") from None
    return _REF.sub(sub, value)


def _need(d: dict, key: str, kind, where: str):
    if key not in d:
        raise ConfigError(f"config field '{where}{key}' is missing")
    v = d[key]
    if not isinstance(v, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"config field '{where}{key}' must be a {want}, got {type(v).__name__}")
    return v


def load_config(path: str) -> JobConfig:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    return parse_config(raw, base=os.path.dirname(os.path.abspath(path)))


def parse_config(raw: dict, base: str = ".") -> JobConfig:
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    src = _need(raw, "source", dict, "")
    out = _need(raw, "output", dict, "")
    topics = _need(src, "topics", list, "source.")
    if not topics or not all(isinstance(t, str) and t for t in topics):
        raise ConfigError("config field 'source.topics' must be a non-empty list of topic names")
    schema = _need(raw, "schema", str, "")
    if schema.startswith("@"):  # @file: a DDL schema in a file beside the config
        p = os.path.join(base, schema[1:])
        try:
            schema = open(p).read().strip()
        except OSError as e:
            raise ConfigError(f"config field 'schema': cannot read {p}: {e.strerror}") from None
    opts = _need(src, "options", dict, "source.") if "options" in src else {}
    for k, v in opts.items():
        if not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"config field 'source.options.{k}' must be a string or number")
        if re.search(r"password|secret|token", k, re.I) and not _REF.search(str(v)):
            raise ConfigError(f"config field 'source.options.{k}' holds a credential: use ${{env:NAME}} or "
                              "${secret:scope/key} instead of the value")
    trigger = raw.get("trigger", "availableNow")
    if not isinstance(trigger, str) or not (trigger == "availableNow" or trigger.startswith("processingTime:")):
        raise ConfigError("config field 'trigger' must be 'availableNow' or 'processingTime:<interval>', "
                          f"got {trigger!r}")
    required = raw.get("required", [])
    if not isinstance(required, list) or not all(isinstance(c, str) for c in required):
        raise ConfigError("config field 'required' must be a list of column names")
    return JobConfig(
        bootstrap_servers=_resolve(_need(src, "bootstrap_servers", str, "source."), "source.bootstrap_servers"),
        group_id=_need(src, "group_id", str, "source."),
        topics=topics,
        schema=schema,
        output_path=_need(out, "path", str, "output."),
        dead_letter_path=_need(out, "dead_letter_path", str, "output."),
        checkpoint_path=_need(out, "checkpoint_path", str, "output."),
        required=required,
        release_if=raw.get("release_if"),
        partition_by=raw.get("partition_by", "event_date"),
        trigger=trigger,
        source_options={k: _resolve(str(v), f"source.options.{k}") for k, v in opts.items()},
        spark_master=raw.get("spark_master"),
    )


@dataclass
class Summary:
    records: int = 0
    written: int = 0
    rejected: Counter = field(default_factory=Counter)
    released: int = 0
    batches: int = 0
    started: float = field(default_factory=time.time)

    def line(self, batch_id: int) -> str:
        return (f"batch {batch_id}: read {self.records}, written {self.written}, "
                f"rejected {sum(self.rejected.values())}, released {self.released}")


def run(spark, cfg: JobConfig, quiet: bool = False) -> Summary:
    """Run the job once (until AvailableNow ends) or until stopped (processingTime)."""
    from pyspark.sql import functions as F

    import spark_share

    spark_share.register(spark)
    try:
        fields = {f.name for f in spark.createDataFrame([], cfg.schema).schema.fields}
    except Exception as e:
        raise ConfigError(f"config field 'schema' is not a valid DDL schema ({cfg.schema!r}): "
                          f"{str(e).splitlines()[0]}") from None
    missing = [c for c in cfg.required if c not in fields]
    if missing:
        raise ConfigError(f"config field 'required' names {missing}, which are not in the schema")

    summary = Summary()
    reader = (spark.readStream.format("kafka-share")
              .option("kafka.bootstrap.servers", cfg.bootstrap_servers)
              .option("kafka.group.id", cfg.group_id)
              .option("subscribe", ",".join(cfg.topics))
              .option("deadLetterPath", cfg.dead_letter_path))
    for k, v in cfg.source_options.items():
        reader = reader.option(k, v)
    stream = reader.load()
    valid = " AND ".join(f"rec.`{c}` IS NOT NULL" for c in cfg.required) or "rec IS NOT NULL"

    def process(batch, batch_id):
        parsed = (batch.withColumn("rec", F.from_json(F.col("value").cast("string"), cfg.schema))
                  .withColumn(cfg.partition_by, F.to_date("timestamp"))
                  .persist())
        try:
            rows = parsed.count()
            ok = parsed.where(valid)
            release = ok.where(cfg.release_if) if cfg.release_if else None
            if release is not None:
                ok = ok.where(f"NOT ({cfg.release_if})")
            (ok.select("rec.*", cfg.partition_by, "topic", "partition", "offset", "deliveryCount")
             .write.mode("append").partitionBy(cfg.partition_by).parquet(cfg.output_path))
            written = ok.count()
            bad = parsed.where(f"NOT ({valid})")
            unparseable = bad.where("rec IS NULL OR to_json(rec) = '{}'")
            invalid = bad.subtract(unparseable) if cfg.required else None
            n_unp = spark_share.reject(unparseable, reason="unparseable JSON")
            n_inv = spark_share.reject(invalid, reason=f"missing required field(s) {cfg.required}") if invalid else 0
            n_rel = spark_share.release(release) if release is not None else 0
        finally:
            parsed.unpersist()
        summary.records += rows
        summary.written += written
        summary.rejected["unparseable JSON"] += n_unp
        if n_inv:
            summary.rejected["missing required fields"] += n_inv
        summary.released += n_rel
        summary.batches += 1
        if not quiet:
            print(summary.line(batch_id), flush=True)

    w = stream.writeStream.foreachBatch(process).option("checkpointLocation", cfg.checkpoint_path)
    if cfg.trigger == "availableNow":
        w = w.trigger(availableNow=True)
    else:
        w = w.trigger(processingTime=cfg.trigger.split(":", 1)[1])
    q = w.start()
    q.awaitTermination()
    return summary


def print_summary(spark, cfg: JobConfig, s: Summary, produced: Optional[int] = None) -> None:
    wall = time.time() - s.started
    out = spark.read.parquet(cfg.output_path) if os.path.exists(cfg.output_path) or "://" in cfg.output_path else None
    dups = 0
    if out is not None:
        total = out.count()
        dups = total - out.select("topic", "partition", "offset").distinct().count()
    print()
    print("spark-share job summary")
    if produced is not None:
        print(f"  produced            {produced:>10,}")
    print(f"  records read        {s.records:>10,}   (includes redeliveries)")
    print(f"  written             {s.written:>10,}   -> {cfg.output_path}")
    for reason, n in sorted(s.rejected.items()):
        print(f"  rejected            {n:>10,}   ({reason}) -> {cfg.dead_letter_path}")
    print(f"  released            {s.released:>10,}   (delivered again later)")
    print(f"  duplicates in table {dups:>10,}")
    print(f"  batches             {s.batches:>10,}")
    print(f"  wall time           {wall:>10.1f} s   ({s.records / wall if wall else 0:,.0f} records/s)")


def synthetic_orders(bootstrap: str, topic: str, n: int, partitions: int, seed: int = 7) -> Dict[str, int]:
    """Orders as JSON; ~2 % malformed, ~1 % missing the amount, ~2 % 'pending' (released once)."""
    from confluent_kafka import Producer

    rnd = random.Random(seed)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    kinds = Counter()
    for i in range(n):
        r = rnd.random()
        if r < 0.02:
            value, kind = b'{"order_id": ' + str(i).encode() + b', "amount": ', "malformed"
        elif r < 0.03:
            value, kind = json.dumps({"order_id": i, "customer": "c1"}).encode(), "invalid"
        else:
            kind = "pending" if r < 0.05 else "ok"
            value = json.dumps({"order_id": i, "customer": f"c{rnd.randrange(500)}",
                                "amount": round(rnd.uniform(1, 900), 2), "status": kind}).encode()
        kinds[kind] += 1
        p.produce(topic, key=str(i).encode(), value=value, partition=i % partitions)
        p.poll(0)
    p.flush(60)
    return dict(kinds)


DEMO_SCHEMA = "order_id long, customer string, amount double, status string"


def demo_config(bootstrap: str, base: str) -> JobConfig:
    return parse_config({
        "source": {"bootstrap_servers": bootstrap, "group_id": "orders-to-table", "topics": ["orders"]},
        "schema": DEMO_SCHEMA,
        "required": ["order_id", "amount"],
        # 'pending' orders hit a transient condition the first time they are seen: try again later.
        "release_if": "rec.status = 'pending' AND deliveryCount = 1",
        "output": {"path": os.path.join(base, "orders"), "dead_letter_path": os.path.join(base, "dead_letters"),
                   "checkpoint_path": os.path.join(base, "checkpoint")},
    })


def main(argv=None, prog: str = "queue_to_table.py") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Drain a Kafka share group into a Parquet table.")
    ap.add_argument("--config", help="JSON config (see conf/); without it, run on the embedded broker")
    ap.add_argument("--records", type=int, default=20000, help="synthetic orders for the embedded run")
    ap.add_argument("--out", help="output directory for the embedded run (default: a new temporary directory)")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    try:
        cfg = load_config(args.config) if args.config else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    builder = SparkSession.builder.appName("spark-share-queue-to-table")
    if cfg is None or cfg.spark_master:
        builder = (builder.master(cfg.spark_master if cfg else "local[2]").config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "2"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if cfg is not None:
            s = run(spark, cfg)
            print_summary(spark, cfg, s)
            return 0
        from .embedded import EmbeddedKafka

        base = args.out or tempfile.mkdtemp(prefix="spark-share-job-")
        with EmbeddedKafka() as kafka:
            kafka.create_topic("orders", 4)
            kinds = synthetic_orders(kafka.bootstrap_servers, "orders", args.records, 4)
            print(f"embedded broker {kafka.bootstrap_servers}: produced {args.records:,} orders {kinds}")
            cfg = demo_config(kafka.bootstrap_servers, base)
            s = run(spark, cfg)
            print_summary(spark, cfg, s, produced=args.records)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
