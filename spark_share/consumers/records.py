"""Messages -> Arrow: the source's schema and the conversion of one poll into a RecordBatch.

Owns: the output schema (Spark and Arrow forms, which must match exactly) and the fast path
from confluent-kafka ``Message`` objects to a ``pyarrow.RecordBatch``; Arrow IPC (de)serialisation
of the cached batches.

Must never: drop or reorder a record (the offsets list returned beside the batch is what gets
acknowledged), or touch a consumer.
"""
from __future__ import annotations

import gc
from collections.abc import Sequence
from itertools import chain

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


def spark_struct(include_headers: bool, offset_metadata: dict):
    """``spark_schema`` as a ``StructType``, with ``offset_metadata`` on the offset column."""
    from pyspark.sql.pandas.types import from_arrow_schema

    struct = from_arrow_schema(arrow_schema(include_headers))
    struct["offset"].metadata = dict(offset_metadata)
    return struct


def arrow_schema(include_headers: bool) -> pa.Schema:
    return ARROW_SCHEMA_HEADERS if include_headers else ARROW_SCHEMA


def empty_batch(include_headers: bool) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=arrow_schema(include_headers))


# Offsets acquired by one poll, as sorted runs: {topic: {partition: [[first, last], ...]}}.
Acquired = dict[str, dict[int, list[list[int]]]]


def to_record_batch(msgs: Sequence, include_headers: bool, topic: str | None = None
                    ) -> tuple[pa.RecordBatch, Acquired]:
    """Convert one poll's messages (none carrying an error) to a RecordBatch, and list the offsets
    acquired. One pass of C-level accessor calls per field, then NumPy; no Python loop per message
    (headers aside)."""
    n = len(msgs)
    schema = arrow_schema(include_headers)
    if not n:
        return empty_batch(include_headers), {}
    # The accessors allocate a tuple or two per message and free them at once: the cyclic
    # collector, triggered every few hundred allocations, would otherwise scan the poll's tens of
    # thousands of messages again and again (it tripled the time).
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _convert(msgs, n, schema, include_headers, topic)
    finally:
        if enabled:
            gc.enable()


def _convert(msgs: Sequence, n: int, schema: pa.Schema, include_headers: bool, topic: str | None
             ) -> tuple[pa.RecordBatch, Acquired]:
    import numpy as np

    m = type(msgs[0])  # confluent_kafka.Message: its unbound methods map faster than a comprehension
    # A consumer of one topic gets only its records: no per-message topic() (a new str each time).
    topic_names = [topic] if topic is not None else list(map(m.topic, msgs))
    parts = np.fromiter(map(m.partition, msgs), np.int32, n)
    offsets = np.fromiter(map(m.offset, msgs), np.int64, n)
    # (type, ms) per message, flattened by one C-level iterator: half the cost of transposing tuples
    ts = np.fromiter(chain.from_iterable(map(m.timestamp, msgs)), np.int64, 2 * n).reshape(n, 2)
    ts_type, ts_ms = ts[:, 0], ts[:, 1]
    no_ts = ts_type == 0  # librdkafka: 0 not available, 1 CreateTime, 2 LogAppendTime
    cols = [
        pa.array(list(map(m.key, msgs)), pa.binary()),
        pa.array(list(map(m.value, msgs)), pa.binary()),
        pa.repeat(pa.scalar(topic, pa.string()), n) if topic is not None else pa.array(topic_names, pa.string()),
        _from_numpy(parts, pa.int32()),
        _from_numpy(offsets, pa.int64()),
        _from_numpy(ts_ms * 1000, pa.timestamp("us", tz="UTC"), valid=~no_ts),
        _from_numpy(np.where(no_ts, -1, ts_type - 1).astype(np.int32), pa.int32()),  # Kafka's 0 / 1
        _delivery_counts(list(map(m.delivery_count, msgs))),
    ]
    if include_headers:
        cols.append(pa.array([[{"key": k, "value": v} for k, v in h] if h else [] for h in map(m.headers, msgs)],
                             _HEADER_TYPE))
    return pa.RecordBatch.from_arrays(cols, schema=schema), _runs(topic_names, parts, offsets)


def _from_numpy(values, type_: pa.DataType, valid=None) -> pa.Array:
    """A fixed-width Arrow array over a NumPy array's memory (pa.array() would import pandas, 0.4 s
    of a fresh agent's first poll, to check its argument)."""
    import numpy as np

    bitmap = None
    if valid is not None and not valid.all():
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(type_, len(values), [bitmap, pa.py_buffer(np.ascontiguousarray(values))])


def _delivery_counts(counts: list) -> pa.Array:
    """Always set on records a share consumer fetched; null where a client left it out."""
    import numpy as np

    try:
        return _from_numpy(np.array(counts, np.int32), pa.int32())
    except TypeError:
        return pa.array(counts, pa.int32())


def _runs(topic_names: list[str], parts, offsets) -> Acquired:
    """The acquired offsets per (topic, partition), as sorted [first, last] runs: compact and exact.

    A fetch returns each partition's records in offset order, one stretch per partition: the runs
    are cut in message order and only sorted when stretches interleave."""
    import numpy as np

    names = list(dict.fromkeys(topic_names))  # few: a poll's subscribed topics
    if len(names) == 1:  # one topic (or the consumer's only one)
        codes = np.zeros(len(offsets), np.int64)
    else:
        index = {t: i for i, t in enumerate(names)}
        codes = np.fromiter(map(index.__getitem__, topic_names), np.int64, len(offsets))
    group = (codes << 32) | parts.astype(np.int64)

    def cuts(g, o):
        return np.flatnonzero((np.diff(g) != 0) | (np.diff(o) != 1)) + 1

    breaks = cuts(group, offsets)
    if len(breaks) > 64 and len(breaks) > len(offsets) // 16:
        order = np.lexsort((offsets, group))
        group, offsets = group[order], offsets[order]
        breaks = cuts(group, offsets)
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(offsets)])) - 1
    out: Acquired = {}
    for key, lo, hi in sorted(zip(group[starts].tolist(), offsets[starts].tolist(), offsets[ends].tolist())):
        runs = out.setdefault(names[key >> 32], {}).setdefault(key & 0xFFFFFFFF, [])
        if runs and runs[-1][1] + 1 == lo:
            runs[-1][1] = hi
        else:
            runs.append([lo, hi])
    return out


def visible(rb: pa.RecordBatch, max_delivery_count: int | None, include_headers: bool) -> tuple[pa.RecordBatch, list]:
    """What Spark sees of a poll: without records past ``max_delivery_count`` (returned as poison,
    ``[topic, partition, offset, deliveryCount]``, rejected to the dead-letter target at commit) and
    without headers unless asked for."""
    poison = []
    if max_delivery_count and rb.num_rows:
        bad = rb.column("deliveryCount").to_numpy() >= max_delivery_count
        if bad.any():
            hit = rb.filter(pa.array(bad))
            poison = [[t, p, o, c] for t, p, o, c in zip(*(hit.column(n).to_pylist() for n in
                                                           ("topic", "partition", "offset", "deliveryCount")))]
            rb = rb.filter(pa.array(~bad))
    if not include_headers and "headers" in rb.schema.names:
        rb = rb.drop_columns(["headers"])
    return rb, poison


def redelivered(rb: pa.RecordBatch) -> int:
    """Rows of a poll that the group delivered before (deliveryCount > 1)."""
    return int((rb.column("deliveryCount").to_numpy() > 1).sum()) if rb.num_rows else 0


class _Warm:
    """A stand-in message: ``warm_up`` converts one to pay the first conversion's one-time costs."""

    def topic(self): return "warm-up"
    def partition(self): return 0
    def offset(self): return 0
    def key(self): return b""
    def value(self): return b""
    def timestamp(self): return (1, 0)
    def delivery_count(self): return 1
    def headers(self): return None


def warm_up() -> None:
    to_record_batch([_Warm()], include_headers=True)


def to_ipc(*batches: pa.RecordBatch) -> pa.Buffer:
    """The batches (one schema, at least one batch) as one Arrow IPC stream, written once into a buffer of its
    exact size (a growing stream buffer copies it again at every doubling, and a copy to bytes once more)."""
    size = pa.MockOutputStream()
    _write_ipc(size, batches)
    buf = pa.allocate_buffer(size.size())
    _write_ipc(pa.FixedSizeBufferWriter(buf), batches)
    return buf


def _write_ipc(sink, batches: Sequence[pa.RecordBatch]) -> None:
    with pa.ipc.new_stream(sink, batches[0].schema) as w:
        for batch in batches:
            if batch.num_rows:
                w.write_batch(batch)


def from_ipc(blob) -> list[pa.RecordBatch]:
    """The batches of an IPC stream in ``blob`` (any bytes-like object; its memory is used, not copied)."""
    reader = pa.ipc.open_stream(pa.py_buffer(blob))
    return [b for b in reader]
