"""Spark's floor for any Python streaming source: a source that only yields prebuilt Arrow batches.

The benchmark runs it beside kafka-share with the same batch sizes, tasks per batch and row shape:
what it costs (wall time, CPU of Spark's Python workers and runner, the JVM) is what Spark's Python
Data Source API costs before a source does any work. Spark's Python processes find it on
PYTHONPATH (bench_common.local_session sets it); not part of the package. It must never do work per
row or per batch: each task's batch is built once per size and yielded again.
"""
from __future__ import annotations

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow

_BATCH = {}


def _prebuilt(rows: int, value_bytes: int):
    if (rows, value_bytes) not in _BATCH:
        import pyarrow as pa

        from spark_share.consumers.records import ARROW_SCHEMA

        _BATCH[rows, value_bytes] = pa.RecordBatch.from_arrays(
            [pa.array([b"%d" % i for i in range(rows)], pa.binary()), pa.array([b"x" * value_bytes] * rows, pa.binary()),
             pa.array(["t"] * rows), pa.array([i % 16 for i in range(rows)], pa.int32()),
             pa.array(range(rows), pa.int64()), pa.array([1_700_000_000_000_000] * rows, pa.timestamp("us", tz="UTC")),
             pa.array([0] * rows, pa.int32()), pa.array([1] * rows, pa.int32())], schema=ARROW_SCHEMA)
    return _BATCH[rows, value_bytes]


class FloorSource(DataSource):
    """options: batches, tasks (per batch), rows (per task), valueBytes (per row, 100 unless given)."""

    @classmethod
    def name(cls):
        return "spark-share-floor"

    def schema(self):
        from spark_share.consumers.records import spark_schema

        return spark_schema(False)

    def streamReader(self, schema):
        return _Reader(int(self.options["batches"]), int(self.options["tasks"]), int(self.options["rows"]),
                       int(self.options.get("valueBytes", 100)))


class _Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, batches: int, tasks: int, rows: int, value_bytes: int):
        self.batches, self.tasks, self.rows, self.value_bytes = batches, tasks, rows, value_bytes

    def prepareForTriggerAvailableNow(self):
        pass

    def initialOffset(self):
        return {"batch": 0}

    def latestOffset(self, start=None, limit=None):
        return {"batch": min(start["batch"] + 1, self.batches)}

    def partitions(self, start, end):
        return [InputPartition((self.rows, self.value_bytes)) for _ in range(self.tasks)]

    def read(self, partition):
        yield _prebuilt(*partition.value)

    def commit(self, end):
        pass
