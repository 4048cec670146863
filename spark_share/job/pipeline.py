"""The per-batch logic of the job: one verdict per row, then write, reject or release; the summary.

Owns: :func:`classify` (parse JSON against the schema, validate, name each row's verdict), the
checks of the config that need Spark to see (schema, ``required``, ``partition_by``,
``release_if``), :func:`run` (the streaming query: append valid rows partitioned by date, reject
invalid rows with a reason to the dead-letter table, release rows that hit a transient condition),
:class:`Summary` and :func:`print_summary`.

Every row of a batch gets exactly one verdict (:func:`classify`): written, rejected with a
reason, or released. Nothing is dropped silently: a row that is not written or released is
rejected to the dead-letter table before its REJECT is sent.

Must never: accept a row before its batch has committed (it only names verdicts; the source
acknowledges), let a batch commit whose rows do not add up, or print a credential.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from ..connect import is_connect
from ..errors import ConfigError, JobError
from .config import JobConfig, resolve_secrets

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


def output_columns(cfg: JobConfig, fields: Sequence[str]) -> list[str]:
    return [f"rec.`{f}`" for f in fields] + [cfg.partition_by, "topic", "partition", "offset",
                                              "deliveryCount"]


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
        raise ConfigError(f"config field 'schema': field(s) {clash} clash with the source columns written "
                          f"beside them ({', '.join(beside)}); rename them")
    if cfg.partition_by in set(fields) | set(beside):
        raise ConfigError(f"config field 'partition_by' = {cfg.partition_by!r} is already a column of the "
                          "output; choose another name")
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
    wall: float | None = None
    # From the start of the first batch that read records to the end of the last one (the query's
    # progress reports): the reading, without the query's start-up and stop.
    reading: float | None = None

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
        # Before the batch commits: nothing is lost.
        if counts[WRITE] + sum(rejected.values()) + released != total:
            raise JobError(f"batch {batch_id}: {total} rows but {counts[WRITE]} written, "
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

    def start():
        if cfg.trigger == "availableNow":
            return spark_share.drain(w)  # Trigger.AvailableNow, or its equivalent where Spark lacks it (< 4.2)
        return w.trigger(processingTime=cfg.trigger.split(":", 1)[1]).start()

    # Under Spark Connect, process() runs in a Python process of the server's: its summary stays
    # there. The client counts from what it can see: the query's progress and the two tables.
    # (Not with a client-side listener: pyspark 4.3's listener bus dies on observed metrics.)
    connect = is_connect(spark)
    before = _TableCounts.read(spark, cfg) if connect else None
    q = start()
    batches = _Batches()
    while True:
        ended = q.awaitTermination(1)
        for p in q.recentProgress:  # the last 100 batches: polled well within 100 batches
            batch = batches.note(p)
            if batch is not None and connect and not quiet:
                print(f"batch {batch}: read {_field(p, 'numInputRows')}", flush=True)
        if ended:
            break
    if before is None:
        summary.wall = time.time() - summary.started
        summary.reading = batches.reading()
        return summary
    s = _TableCounts.read(spark, cfg).summary_since(before, batches.rows, summary.started)
    s.reading = batches.reading()
    return s


def _field(progress, name: str):
    """A field of a progress report: an attribute of Spark Connect's ``StreamingQueryProgress`` (its items are
    not filled there), an item of the dict classic PySpark gives."""
    value = getattr(progress, name, None)
    if value is None and isinstance(progress, dict):
        value = progress.get(name)
    return value


class _Batches:
    """The query's batches as its progress reports tell them: rows per batch id, and when the first batch
    that read records started and the last one ended. A report is a dict (a subclass of it on PySpark >= 4.0)
    with the trigger's start (``timestamp``, UTC) and its duration (``durationMs.triggerExecution``, the
    batch's planning, reads, foreachBatch and commit)."""

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}
        self._seen: set[tuple[int, str]] = set()
        self._first: float | None = None
        self._last: float | None = None

    def note(self, progress) -> int | None:
        """Take one report; the batch id when the batch is new (a report without data repeats the id
        of the batch to come, so reports are told apart by id and start)."""
        batch, stamp = int(_field(progress, "batchId")), str(_field(progress, "timestamp"))
        if (batch, stamp) in self._seen:
            return None
        self._seen.add((batch, stamp))
        rows = int(_field(progress, "numInputRows") or 0)
        new = batch not in self.rows
        self.rows[batch] = self.rows.get(batch, 0) + rows
        if rows:
            started = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            took = (_field(progress, "durationMs") or {}).get("triggerExecution", _field(progress, "batchDuration") or 0)
            self._first = started if self._first is None else min(self._first, started)
            self._last = max(self._last or started, started + took / 1000)
        return batch if new or rows else None

    def reading(self) -> float | None:
        """Seconds from the start of the first batch that read records to the end of the last one."""
        if self._first is None or self._last is None:
            return None
        return self._last - self._first


@dataclass
class _TableCounts:
    """Rows in the output and dead-letter tables (by reason), to count a run by difference."""

    written: int
    rejected: Counter

    @classmethod
    def read(cls, spark, cfg: JobConfig) -> _TableCounts:
        out = _read_table(spark, cfg.output_path)
        dead = _read_table(spark, cfg.dead_letter_path)
        reasons = Counter({r[0]: r[1] for r in dead.groupBy("reason").count().collect()}) if dead else Counter()
        return cls(out.count() if out is not None else 0, reasons)

    def summary_since(self, before: _TableCounts, batch_rows: dict[int, int], started: float) -> Summary:
        s = Summary(started=started, wall=time.time() - started)
        s.records, s.batches = sum(batch_rows.values()), len(batch_rows)
        s.written = self.written - before.written
        for reason, n in (self.rejected - before.rejected).items():
            s.rejected[_summary_label(reason)] += n
        s.released = s.records - s.written - sum(s.rejected.values())
        return s


def _read_table(spark, path: str):
    """The Parquet table at ``path``, or None when there is none yet (no such path, or no files:
    an empty first run). Works for any scheme (dbfs:, s3://, /Volumes/..., local)."""
    from pyspark.errors import AnalysisException

    try:
        table = spark.read.parquet(path)
        table.schema  # noqa: B018 -- Spark Connect analyses lazily: a missing path raises here
        return table
    except AnalysisException:
        return None


def print_summary(spark, cfg: JobConfig, s: Summary, produced: int | None = None) -> None:
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
    print(f"  duplicates in table {dups:>10,}"
          + (f"   ({table_note})" if table_note.startswith("not") else ""))
    print(f"  batches             {s.batches:>10,}")
    if s.reading:
        print(f"  reading             {s.reading:>10.1f} s   ({s.records / s.reading:,.0f} records/s, "
              "from the first batch's start to the last batch's end)")
    print(f"  wall time           {wall:>10.1f} s   ({s.records / wall if wall else 0:,.0f} records/s, "
          "the query's start-up and stop included)")
    print(f"  output table        {cfg.output_path}   "
          + (f"({table_note})" if table_note else f"({rows:,} rows, partitioned by {cfg.partition_by})"))
    print(f"  dead-letter table   {cfg.dead_letter_path}   (rejected records with their reason)")
