"""benchmark.py's decode section: messages -> Arrow on one core, as the agent converts a poll, against
per-message Python tuples built into the same columns. No Spark, no broker: the messages are made here.

It must never time the building of the messages, only their conversion; the best of a few repeats is
taken, so a busy machine's pauses do not count.
"""
from __future__ import annotations

import time


def decode_bench(n=300_000, repeats=5):
    """Messages -> Arrow on one core, as the agent converts a poll (one subscribed topic; a fetch
    returns each partition's records as one stretch), against per-message Python tuples."""
    import pyarrow as pa
    from confluent_kafka import Message

    from spark_share.consumers import records

    msgs = [Message(topic="orders", partition=p, offset=o, key=str(o).encode(), value=b"x" * 100,
                    timestamp=(1, 1_700_000_000_000 + o), delivery_count=1) for p in range(4) for o in range(n // 4)]
    records.warm_up()

    def naive(ms):  # per-message Python tuples, then columns
        rows = [(m.key(), m.value(), m.topic(), m.partition(), m.offset(), m.timestamp()[1] * 1000,
                 m.timestamp()[0] - 1, m.delivery_count()) for m in ms]
        cols = list(zip(*rows))
        types = [pa.binary(), pa.binary(), pa.string(), pa.int32(), pa.int64(), pa.timestamp("us", tz="UTC"),
                 pa.int32(), pa.int32()]
        return pa.RecordBatch.from_arrays([pa.array(c, t) for c, t in zip(cols, types)],
                                          schema=records.ARROW_SCHEMA)

    def best(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(msgs)
            times.append(time.perf_counter() - t0)
        return n / min(times)

    return {"ours_rows_per_s": best(lambda m: records.to_record_batch(m, False, topic="orders")),
            "naive_rows_per_s": best(naive)}
