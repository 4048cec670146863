"""The scheduled job: drain a share group into a Parquet table, set bad records aside, stop.

Owns: the job's config (JSON; credentials from the environment or a Databricks secret scope,
never from the file), the per-batch logic (parse JSON against a schema, validate, append valid
rows partitioned by date, reject invalid rows with a reason to the dead-letter table, release
rows that hit a transient condition) and the summary it prints. ``jobs/queue_to_table.py`` is the
file people run; with no ``--config`` it runs on the embedded broker with a synthetic workload,
and so does a config whose ``source.bootstrap_servers`` is ``"embedded"`` (conf/local.json).

Every row of a batch gets exactly one verdict (:func:`classify`): written, rejected with a
reason, or released. Nothing is dropped silently: a row that is not written or released is
rejected to the dead-letter table before its REJECT is sent.

Must never: hold credentials in a config file or print them, or accept a row before its batch
has committed (it only names verdicts; the source acknowledges).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .options import is_secret, scrub

EMBEDDED = "embedded"  # source.bootstrap_servers: start the embedded broker and produce synthetic orders


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
    source_options: Dict[str, str] = field(default_factory=dict, repr=False)  # may hold credentials
    spark_master: Optional[str] = None


_REF = re.compile(r"\$\{(env|secret):([^}]*)\}")
_SECRET_REF = re.compile(r"\$\{secret:([^}]*)\}")


def _dbutils_available() -> bool:
    if "pyspark.dbutils" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("pyspark.dbutils") is not None
    except (ImportError, ValueError):
        return False


def _resolve_env(value: str, where: str) -> str:
    """Replace ``${env:NAME}`` by the environment variable; check ``${secret:scope/key}`` references
    (resolved later, by :func:`resolve_secrets`, once a Spark session exists)."""
    def sub(m):
        kind, ref = m.group(1), m.group(2)
        if kind == "env":
            if not ref:
                raise ConfigError(f"config field '{where}': ${{env:}} needs a variable name")
            if ref not in os.environ:
                raise ConfigError(f"config field '{where}': environment variable {ref} is not set")
            return os.environ[ref]
        scope, _, key = ref.partition("/")
        if not scope or not key:
            raise ConfigError(f"config field '{where}': write a secret as ${{secret:scope/key}}, got ${{secret:{ref}}}")
        if not _dbutils_available():
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} needs Databricks secret scopes; use "
                              "${env:NAME} elsewhere")
        return m.group(0)
    return _REF.sub(sub, value)


def resolve_secrets(cfg: JobConfig, spark=None) -> JobConfig:
    """``cfg`` with every ``${secret:scope/key}`` read from the Databricks secret scope. Needs a Spark
    session (the active one, or one is created); any failure is a ConfigError naming the field and
    never holding a secret value."""
    fields = [("source.bootstrap_servers", cfg.bootstrap_servers), ("source.group_id", cfg.group_id)]
    fields += [(f"source.options.{k}", v) for k, v in cfg.source_options.items()]
    if not any(_SECRET_REF.search(v) for _, v in fields):
        return cfg
    found: List[str] = []
    dbutils = None

    def sub(m, where):
        nonlocal dbutils
        ref = m.group(1)
        scope, _, key = ref.partition("/")
        try:
            if dbutils is None:
                from pyspark.dbutils import DBUtils  # Databricks only
                from pyspark.sql import SparkSession

                session = spark or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
                dbutils = DBUtils(session)
            value = dbutils.secrets.get(scope=scope, key=key)
        except ImportError:
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} needs Databricks secret scopes; use "
                              "${env:NAME} elsewhere") from None
        except Exception as e:
            detail = scrub(str(e).strip().splitlines()[0][:200] if str(e).strip() else "", found)
            raise ConfigError(f"config field '{where}': cannot read ${{secret:{ref}}} from the Databricks secret "
                              f"scope ({type(e).__name__}{': ' + detail if detail else ''})") from None
        if not isinstance(value, str):
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} did not return a string")
        found.append(value)
        return value

    def res(value: str, where: str) -> str:
        return _SECRET_REF.sub(lambda m: sub(m, where), value)

    return dataclasses.replace(
        cfg,
        bootstrap_servers=res(cfg.bootstrap_servers, "source.bootstrap_servers"),
        group_id=res(cfg.group_id, "source.group_id"),
        source_options={k: res(v, f"source.options.{k}") for k, v in cfg.source_options.items()},
    )


def _need(d: dict, key: str, kind, where: str):
    if key not in d:
        raise ConfigError(f"config field '{where}{key}' is missing")
    v = d[key]
    if not isinstance(v, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"config field '{where}{key}' must be a {want}, got {type(v).__name__}")
    return v


def _optional_str(raw: dict, key: str, default: Optional[str], allow_none: bool = True) -> Optional[str]:
    v = raw.get(key, default)
    if v is None and allow_none:
        return None
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"config field '{key}' must be a non-empty string, got {type(v).__name__} {v!r}")
    return v


_JAAS_LITERAL = re.compile(r"(password|secret|token|credential)\w*\s*=\s*(\"[^\"]+\"|'[^']+'|[^\s\"';]+)", re.I)


def _check_credential(key: str, value: str) -> None:
    """A credential option must come from ``${env:..}``/``${secret:..}``, not be written in the file."""
    if not is_secret(key):
        return
    rest = _REF.sub("", value)
    literal = bool(_JAAS_LITERAL.search(rest)) if "jaas" in key.lower() else bool(rest.strip())
    if literal:
        raise ConfigError(f"config field 'source.options.{key}' holds a credential: use ${{env:NAME}} or "
                          "${secret:scope/key} instead of the value")


def _option_text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)  # Spark options say true/false


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
    """Check a config (every error names its field) and resolve ``${env:NAME}``. ``${secret:..}``
    references are checked here and read by :func:`resolve_secrets` (``run`` calls it)."""
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
            with open(p) as f:
                schema = f.read().strip()
        except OSError as e:
            raise ConfigError(f"config field 'schema': cannot read {p}: {e.strerror}") from None
    opts = _need(src, "options", dict, "source.") if "options" in src else {}
    for k, v in opts.items():
        if not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"config field 'source.options.{k}' must be a string or number")
        _check_credential(k, _option_text(v))
    trigger = raw.get("trigger", "availableNow")
    if not isinstance(trigger, str) or not (trigger == "availableNow" or trigger.startswith("processingTime:")):
        raise ConfigError("config field 'trigger' must be 'availableNow' or 'processingTime:<interval>', "
                          f"got {trigger!r}")
    required = raw.get("required", [])
    if not isinstance(required, list) or not all(isinstance(c, str) and c for c in required):
        raise ConfigError("config field 'required' must be a list of column names")
    return JobConfig(
        bootstrap_servers=_resolve_env(_need(src, "bootstrap_servers", str, "source."), "source.bootstrap_servers"),
        group_id=_resolve_env(_need(src, "group_id", str, "source."), "source.group_id"),
        topics=topics,
        schema=schema,
        output_path=_need(out, "path", str, "output."),
        dead_letter_path=_need(out, "dead_letter_path", str, "output."),
        checkpoint_path=_need(out, "checkpoint_path", str, "output."),
        required=required,
        release_if=_optional_str(raw, "release_if", None),
        partition_by=_optional_str(raw, "partition_by", "event_date", allow_none=False),
        trigger=trigger,
        source_options={k: _resolve_env(_option_text(v), f"source.options.{k}") for k, v in opts.items()},
        spark_master=_optional_str(raw, "spark_master", None),
    )


# --- the per-batch logic ------------------------------------------------------------------------
VERDICT = "_spark_share_verdict"
_PARSED = "_spark_share_parsed"
_CORRUPT = "_spark_share_corrupt_record"
WRITE, RELEASE = "write", "release"
UNPARSEABLE = "unparseable JSON"
MISMATCH = "JSON does not match the schema"


def missing_reason(required: Sequence[str]) -> str:
    return f"missing required field(s) {list(required)}"


def _summary_label(reason: str) -> str:
    return "missing required fields" if reason.startswith("missing required field") else reason


def classify(df, cfg: JobConfig, schema):
    """``df`` (the source's columns) with ``rec`` (the value parsed against ``schema``, a StructType),
    the partition column and ``VERDICT``: ``'write'``, ``'release'`` or the reason of a reject.

    Exactly one verdict per row, in this order: unparseable JSON (NULL or empty value, not JSON)
    or JSON that does not match the schema (an array, a scalar, a field of the wrong type) ->
    reject; a ``required`` field is NULL -> reject; ``release_if`` is true -> release; anything
    else (including rows for which ``release_if`` is NULL) -> write. Malformed values are found
    with from_json's corrupt-record column, so this works with ``required`` empty too.
    """
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructType

    parse_schema = StructType(list(schema.fields)).add(_CORRUPT, StringType())
    text = F.col("value").cast("string")
    parsed = (df.withColumn(_PARSED, F.from_json(text, parse_schema, {"mode": "PERMISSIVE",
                                                                      "columnNameOfCorruptRecord": _CORRUPT}))
              .withColumn("rec", F.col(_PARSED).dropFields(_CORRUPT))
              .withColumn(cfg.partition_by, F.to_date("timestamp")))
    bad_json = F.col(_PARSED).isNull() | F.col(f"{_PARSED}.{_CORRUPT}").isNotNull()
    not_json = F.col("value").isNull() | F.expr("try_parse_json(CAST(value AS STRING))").isNull()
    verdict = F.when(bad_json, F.when(not_json, F.lit(UNPARSEABLE)).otherwise(F.lit(MISMATCH)))
    if cfg.required:
        complete = F.expr(" AND ".join(f"rec.`{c}` IS NOT NULL" for c in cfg.required))
        verdict = verdict.when(~complete, F.lit(missing_reason(cfg.required)))
    if cfg.release_if:
        # coalesce: a NULL condition (e.g. rec.status is NULL) means "do not release", so the row is written.
        verdict = verdict.when(F.coalesce(F.expr(f"({cfg.release_if})"), F.lit(False)), F.lit(RELEASE))
    return parsed.withColumn(VERDICT, verdict.otherwise(F.lit(WRITE))).drop(_PARSED)


def output_columns(cfg: JobConfig, fields: Sequence[str]) -> List[str]:
    return [f"rec.`{f}`" for f in fields] + [cfg.partition_by, "topic", "partition", "offset", "deliveryCount"]


def _check_against_schema(spark, cfg: JobConfig):
    """The schema as a StructType; config errors that need Spark to see (schema, required,
    partition_by) name their field."""
    try:
        schema = spark.createDataFrame([], cfg.schema).schema
    except Exception as e:
        raise ConfigError(f"config field 'schema' is not a valid DDL schema ({cfg.schema!r}): "
                          f"{str(e).strip().splitlines()[0]}") from None
    fields = [f.name for f in schema.fields]
    missing = [c for c in cfg.required if c not in fields]
    if missing:
        raise ConfigError(f"config field 'required' names {missing}, which are not in the schema")
    beside = ["topic", "partition", "offset", "deliveryCount"]  # written with each row
    clash = [f for f in fields if f in beside]
    if clash:
        raise ConfigError(f"config field 'schema': field(s) {clash} clash with the source columns written beside "
                          f"them ({', '.join(beside)}); rename them")
    if cfg.partition_by in set(fields) | set(beside):
        raise ConfigError(f"config field 'partition_by' = {cfg.partition_by!r} is already a column of the output; "
                          "choose another name")
    return schema


def _check_release_if(stream, cfg: JobConfig, schema) -> None:
    """``release_if`` must be a valid true/false condition over the source's columns and ``rec``."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import BooleanType, NullType

    if not cfg.release_if:
        return
    probe = stream.withColumn("rec", F.from_json(F.col("value").cast("string"), schema))
    try:
        kind = probe.select(F.expr(f"({cfg.release_if})").alias("c")).schema["c"].dataType
    except Exception as e:
        raise ConfigError(f"config field 'release_if' is not a valid condition ({cfg.release_if!r}): "
                          f"{str(e).strip().splitlines()[0]}") from None
    if not isinstance(kind, (BooleanType, NullType)):
        raise ConfigError(f"config field 'release_if' must be a true/false condition, got a "
                          f"{kind.simpleString()} ({cfg.release_if!r})")


@dataclass
class Summary:
    records: int = 0
    written: int = 0
    rejected: Counter = field(default_factory=Counter)
    released: int = 0
    batches: int = 0
    started: float = field(default_factory=time.time)
    wall: Optional[float] = None

    def line(self, batch_id: int) -> str:
        return (f"batch {batch_id}: read {self.records}, written {self.written}, "
                f"rejected {sum(self.rejected.values())}, released {self.released}")


def run(spark, cfg: JobConfig, quiet: bool = False) -> Summary:
    """Run the job once (until AvailableNow ends) or until stopped (processingTime)."""
    from pyspark.sql import functions as F

    import spark_share

    cfg = resolve_secrets(cfg, spark)
    spark_share.register(spark)
    schema = _check_against_schema(spark, cfg)
    fields = [f.name for f in schema.fields]
    columns = output_columns(cfg, fields)

    summary = Summary()
    reader = (spark.readStream.format("kafka-share")
              .option("kafka.bootstrap.servers", cfg.bootstrap_servers)
              .option("kafka.group.id", cfg.group_id)
              .option("subscribe", ",".join(cfg.topics))
              .option("deadLetterPath", cfg.dead_letter_path))
    for k, v in cfg.source_options.items():
        reader = reader.option(k, v)
    stream = reader.load()
    _check_release_if(stream, cfg, schema)

    def process(batch, batch_id):
        rows = classify(batch, cfg, schema).persist()
        try:
            counts = Counter({r[0]: r[1] for r in rows.groupBy(VERDICT).count().collect()})
            total = sum(counts.values())
            if counts[WRITE]:
                (rows.where(F.col(VERDICT) == WRITE).select(*columns)
                 .write.mode("append").partitionBy(cfg.partition_by).parquet(cfg.output_path))
            rejected = Counter()
            for reason in sorted(r for r in counts if r not in (WRITE, RELEASE)):
                rejected[reason] = spark_share.reject(rows.where(F.col(VERDICT) == reason), reason=reason)
            released = spark_share.release(rows.where(F.col(VERDICT) == RELEASE)) if counts[RELEASE] else 0
        finally:
            rows.unpersist()
        if counts[WRITE] + sum(rejected.values()) + released != total:  # before the batch commits: nothing is lost
            raise RuntimeError(f"batch {batch_id}: {total} rows but {counts[WRITE]} written, "
                               f"{sum(rejected.values())} rejected, {released} released")
        summary.records += total
        summary.written += counts[WRITE]
        for reason, n in rejected.items():
            summary.rejected[_summary_label(reason)] += n
        summary.released += released
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
    summary.wall = time.time() - summary.started
    return summary


def _read_table(spark, path: str):
    """The Parquet table at ``path``, or None when there is none yet (no such path, or no files:
    an empty first run). Works for any scheme (dbfs:, s3://, /Volumes/..., local)."""
    from pyspark.errors import AnalysisException

    try:
        return spark.read.parquet(path)
    except AnalysisException:
        return None


def print_summary(spark, cfg: JobConfig, s: Summary, produced: Optional[int] = None) -> None:
    wall = s.wall if s.wall is not None else time.time() - s.started
    rows = dups = 0
    table_note = ""
    try:
        out = _read_table(spark, cfg.output_path)
        if out is not None:
            rows = out.count()
            dups = rows - out.select("topic", "partition", "offset").distinct().count()
        else:
            table_note = "no files yet"
    except Exception as e:  # the run has succeeded: a summary that cannot read the table says so
        table_note = f"not read: {type(e).__name__}"
    n_rej = sum(s.rejected.values())
    reasons = ", ".join(f"{reason} {n:,}" for reason, n in sorted(s.rejected.items()))
    print()
    print("spark-share job summary")
    if produced is not None:
        print(f"  produced            {produced:>10,}")
    print(f"  records read        {s.records:>10,}   (includes redeliveries)")
    print(f"  written             {s.written:>10,}")
    print(f"  rejected            {n_rej:>10,}" + (f"   ({reasons})" if reasons else ""))
    print(f"  released            {s.released:>10,}   (delivered again later)")
    print(f"  duplicates in table {dups:>10,}" + (f"   ({table_note})" if table_note.startswith("not") else ""))
    print(f"  batches             {s.batches:>10,}")
    print(f"  wall time           {wall:>10.1f} s   ({s.records / wall if wall else 0:,.0f} records/s)")
    print(f"  output table        {cfg.output_path}   "
          + (f"({table_note})" if table_note else f"({rows:,} rows, partitioned by {cfg.partition_by})"))
    print(f"  dead-letter table   {cfg.dead_letter_path}   (rejected records with their reason)")


# --- the embedded broker and the synthetic workload -------------------------------------------------
def produce_waiting(producer, topic: str, **record) -> None:
    """``producer.produce`` that waits for room when the local queue is full instead of failing."""
    while True:
        try:
            producer.produce(topic, **record)
            break
        except BufferError:
            producer.poll(0.1)
    producer.poll(0)


def synthetic_orders(bootstrap: str, topic: str, n: int, partitions: int, seed: int = 7) -> Dict[str, int]:
    """Orders as JSON: ~2 % malformed, ~1 % missing the amount, ~2 % 'pending' (released once),
    ~5 % without a status (release_if is NULL for them: written), the rest 'ok'."""
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
        elif r < 0.08:
            kind = "no_status"
            value = json.dumps({"order_id": i, "customer": f"c{rnd.randrange(500)}",
                                "amount": round(rnd.uniform(1, 900), 2)}).encode()
        else:
            kind = "pending" if r < 0.10 else "ok"
            value = json.dumps({"order_id": i, "customer": f"c{rnd.randrange(500)}",
                                "amount": round(rnd.uniform(1, 900), 2), "status": kind}).encode()
        kinds[kind] += 1
        produce_waiting(p, topic, key=str(i).encode(), value=value, partition=i % partitions)
    left = p.flush(60)
    if left:
        raise RuntimeError(f"{left} synthetic orders were not delivered to {topic}")
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


_MARK = ".spark-share-embedded"


def prepare_embedded_paths(cfg: JobConfig) -> List[str]:
    """An embedded broker lives as long as the run, so the tables and checkpoint of an earlier
    embedded run are removed (they would mix two brokers' offsets). Paths that hold anything
    else are never touched: that is a ConfigError."""
    paths = [("output.path", cfg.output_path), ("output.dead_letter_path", cfg.dead_letter_path),
             ("output.checkpoint_path", cfg.checkpoint_path)]
    for name, p in paths:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", p) and not p.startswith("file:"):
            raise ConfigError(f"config field '{name}': an embedded-broker run writes local paths only, got {p!r}")
    local = [(name, p[len("file:"):] if p.startswith("file:") else p) for name, p in paths]
    def used(p):
        return os.path.isdir(p) and bool(set(os.listdir(p)) - {_MARK})

    for name, p in local:
        if used(p) and not os.path.exists(os.path.join(p, _MARK)):
            raise ConfigError(f"config field '{name}': {p} already holds data that is not from an embedded-broker "
                              "run; give an empty or new directory")
    removed = []
    for name, p in local:
        if used(p):
            shutil.rmtree(p)
            removed.append(p)
        os.makedirs(p, exist_ok=True)
        with open(os.path.join(p, _MARK), "w") as f:
            f.write("written by an embedded-broker run of spark-share's job; removed by the next one\n")
    return removed


def _find_config(path: str, search: Sequence[str]) -> str:
    """A relative --config is looked up in the current directory, then in each of ``search`` (the
    repository root: on Databricks the working directory is the script's, jobs/)."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    for root in search:
        candidate = os.path.join(root, path)
        if os.path.exists(candidate):
            return candidate
    return path


def main(argv=None, prog: str = "queue_to_table.py", search: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Drain a Kafka share group into a Parquet table. "
                                 "Without --config (or with source.bootstrap_servers = \"embedded\"), it starts the "
                                 "embedded broker and produces synthetic orders first.")
    ap.add_argument("--config", help="JSON config (see conf/); without it, run on the embedded broker")
    ap.add_argument("--records", type=int, default=20000, help="synthetic orders per topic for an embedded run")
    ap.add_argument("--out", help="output directory of the run without --config (default: a new temporary directory)")
    args = ap.parse_args(argv)
    if args.records < 0:
        ap.error("--records must be >= 0")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    try:
        if args.config:
            cfg = load_config(_find_config(args.config, search))
        else:
            cfg = demo_config(EMBEDDED, args.out or tempfile.mkdtemp(prefix="spark-share-job-"))
        embedded = cfg.bootstrap_servers == EMBEDDED
        if embedded:
            for p in prepare_embedded_paths(cfg):
                print(f"removed {p} (from an earlier embedded-broker run)", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    builder = SparkSession.builder.appName("spark-share-queue-to-table")
    if cfg.spark_master or (embedded and not args.config):
        builder = (builder.master(cfg.spark_master or "local[2]").config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "2"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        if not embedded:
            s = run(spark, cfg)
            print_summary(spark, cfg, s)
            return 0
        from .embedded import EmbeddedKafka

        with EmbeddedKafka() as kafka:
            kinds: Counter = Counter()
            for topic in cfg.topics:
                kafka.create_topic(topic, 4)
                kinds.update(synthetic_orders(kafka.bootstrap_servers, topic, args.records, 4))
            produced = args.records * len(cfg.topics)
            print(f"embedded broker {kafka.bootstrap_servers}: produced {produced:,} orders {dict(kinds)}", flush=True)
            cfg = dataclasses.replace(cfg, bootstrap_servers=kafka.bootstrap_servers)
            s = run(spark, cfg)
            print_summary(spark, cfg, s, produced=produced)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
