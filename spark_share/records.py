"""Messages -> Arrow: the source's schema and the conversion of one poll into a RecordBatch.

Owns: the output schema (Spark and Arrow forms, which must match exactly) and the fast path
from confluent-kafka ``Message`` objects to a ``pyarrow.RecordBatch``; Arrow IPC (de)serialisation
of the cached batches.

Must never: drop or reorder a record (the offsets list returned beside the batch is what gets
acknowledged), or touch a consumer.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import pyarrow as pa

SPARK_SCHEMA = ("key binary, value binary, topic string, partition int, offset long, "
                "timestamp timestamp, timestampType int, deliveryCount int")
SPARK_HEADERS = ", headers array<struct<key: string, value: binary>>"

_HEADER_TYPE = pa.list_(pa.struct([pa.field("key", pa.string()), pa.field("value", pa.binary())]))
_BASE_FIELDS = [
    pa.field("key", pa.binary()),
    pa.field("value", pa.binary()),
    pa.field("topic", pa.string()),
    pa.field("partition", pa.int32()),
    pa.field("offset", pa.int64()),
    pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    pa.field("timestampType", pa.int32()),
    pa.field("deliveryCount", pa.int32()),
]
ARROW_SCHEMA = pa.schema(_BASE_FIELDS)
ARROW_SCHEMA_HEADERS = pa.schema(_BASE_FIELDS + [pa.field("headers", _HEADER_TYPE)])


def spark_schema(include_headers: bool) -> str:
    return SPARK_SCHEMA + (SPARK_HEADERS if include_headers else "")


def arrow_schema(include_headers: bool) -> pa.Schema:
    return ARROW_SCHEMA_HEADERS if include_headers else ARROW_SCHEMA


# Offsets acquired by one poll, grouped: {topic: {partition: [offsets]}}.
Acquired = Dict[str, Dict[int, List[int]]]


def to_record_batch(msgs: Sequence, include_headers: bool) -> Tuple[pa.RecordBatch, Acquired, List[Tuple]]:
    """Convert one poll's messages. Returns the batch, the acquired offsets, and the errors
    (``(topic, partition, offset, error)`` for messages that carried an error instead of data)."""
    good = [m for m in msgs if m.error() is None]
    errors = [(m.topic(), m.partition(), m.offset(), m.error()) for m in msgs if m.error() is not None] \
        if len(good) != len(msgs) else []
    n = len(good)
    keys = [m.key() for m in good]
    values = [m.value() for m in good]
    topics = [m.topic() for m in good]
    parts = [m.partition() for m in good]
    offsets = [m.offset() for m in good]
    ts = [m.timestamp() for m in good]
    counts = [m.delivery_count() for m in good]
    # timestamp() is (type, ms); type 0 means "not available".
    ts_type = [t[0] for t in ts]
    ts_us = [t[1] * 1000 if t[0] else None for t in ts]
    cols = [
        pa.array(keys, pa.binary()),
        pa.array(values, pa.binary()),
        pa.array(topics, pa.string()),
        pa.array(parts, pa.int32()),
        pa.array(offsets, pa.int64()),
        pa.array(ts_us, pa.timestamp("us", tz="UTC")),
        # Kafka's timestampType: 0 CreateTime, 1 LogAppendTime (librdkafka: 1 and 2)
        pa.array([t - 1 if t else -1 for t in ts_type], pa.int32()),
        pa.array(counts, pa.int32()),
    ]
    if include_headers:
        hs = [m.headers() for m in good]
        cols.append(pa.array([[{"key": k, "value": v} for k, v in h] if h else [] for h in hs], _HEADER_TYPE))
    batch = pa.RecordBatch.from_arrays(cols, schema=arrow_schema(include_headers))
    # Group the offsets per partition in Arrow rather than in a Python loop.
    acquired: Acquired = {}
    if n:
        grouped = (pa.Table.from_arrays([cols[2], cols[3], cols[4]], names=["t", "p", "o"])
                   .group_by(["t", "p"], use_threads=False).aggregate([("o", "list")]))
        for t, p, offs in zip(grouped["t"].to_pylist(), grouped["p"].to_pylist(), grouped["o_list"].to_pylist()):
            acquired.setdefault(t, {})[p] = offs
    assert batch.num_rows == n
    return batch, acquired, errors


def to_ipc(batch: pa.RecordBatch) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        if batch.num_rows:
            w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def from_ipc(blob: bytes) -> List[pa.RecordBatch]:
    reader = pa.ipc.open_stream(pa.py_buffer(blob))
    return [b for b in reader]
