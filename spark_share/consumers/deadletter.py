"""Dead letters: where REJECTed records are written before their REJECT is sent.

Owns: the two targets (a Kafka topic, written with an idempotent producer and flushed; a
Parquet table path, one file per batch and slot) and the fields added to each record (reason,
source coordinates, delivery count, query id, batch id). Used by the agent, which holds the original records, when the
tracker acknowledges a batch that has rejects.

Must never: report success before the records are durable at the target (the producer is
flushed, the file closed), or drop a field of the original record.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa

from ..deadletter_target import filesystem
from ..errors import DeadLetterError
from ..verdict_set import VerdictSet

HEADER_PREFIX = "spark-share."



def rejected_table(batch: pa.RecordBatch, wanted: VerdictSet, query_id: str | None, batch_id: int) -> pa.Table:
    """The rows of ``batch`` that ``wanted`` names (its rejects, with their reasons), with the
    dead-letter fields added."""
    topics = np.array(batch.column("topic").to_pylist(), dtype=object)
    parts = batch.column("partition").to_numpy()
    offsets = batch.column("offset").to_numpy()
    idx: list[np.ndarray] = []
    reasons: list[str | None] = []
    for topic, part in sorted(set(zip(topics.tolist(), parts.tolist()))):
        rows = np.flatnonzero((topics == topic) & (parts == part))
        hit, why = wanted.reasons_for(topic, part, offsets[rows])
        idx.append(rows[hit])
        reasons += why
    order = np.concatenate(idx) if idx else np.zeros(0, np.int64)
    keep = np.argsort(order, kind="stable")  # the batch's own row order
    order, reasons = order[keep], [reasons[i] for i in keep]
    rows_table = pa.Table.from_batches([batch]).take(pa.array(order, pa.int64()))
    n = rows_table.num_rows
    return (rows_table.append_column("reason", pa.array(reasons, pa.string()))
            .append_column("queryId", pa.array([query_id] * n, pa.string()))
            .append_column("rejectedAt", pa.array([int(time.time() * 1e6)] * n, pa.timestamp("us", tz="UTC"))))


class DeadLetterWriter:
    def __init__(self, topic: str | None, path: str | None, producer_config: dict[str, str]):
        self.topic = topic
        self.path = path
        self._producer_config = producer_config
        self._producer = None

    def connect(self, timeout_s: float = 30.0) -> None:
        """Open the producer and its broker connections now rather than at the first reject."""
        if self.topic:
            self._producer_for().list_topics(self.topic, timeout=timeout_s)

    def _producer_for(self):
        from confluent_kafka import Producer

        if self._producer is None:
            conf = dict(self._producer_config)
            conf.update({"enable.idempotence": "true", "acks": "all", "logger": logging.getLogger("spark_share.kafka")})
            self._producer = Producer(conf)
        return self._producer

    def write(self, table: pa.Table, batch_id: int, name: str) -> int:
        if table.num_rows == 0:
            return 0
        if self.topic:
            return self._to_topic(table, batch_id)
        return self._to_path(table, batch_id, name)

    def _to_path(self, table: pa.Table, batch_id: int, name: str) -> int:
        import pyarrow.parquet as pq

        assert self.path is not None
        fs, base = filesystem(self.path)
        d = f"{base.rstrip('/')}/batchId={batch_id}"
        fs.create_dir(d, recursive=True)
        tmp = f"{d}/.{name}.parquet.tmp"
        pq.write_table(table, tmp, filesystem=fs)
        fs.move(tmp, f"{d}/{name}.parquet")  # readers never see a half-written file
        return table.num_rows

    def _to_topic(self, table: pa.Table, batch_id: int) -> int:
        from confluent_kafka import KafkaException

        producer = self._producer_for()
        errors: list[str] = []

        def delivered(err, _msg):
            if err is not None:
                errors.append(f"{err.name()} ({err.code()})" if hasattr(err, "name") else str(err))

        cols = table.to_pydict()
        has_headers = "headers" in cols
        for i in range(table.num_rows):
            headers = [(h["key"], h["value"]) for h in (cols["headers"][i] or [])] if has_headers else []
            headers += [(HEADER_PREFIX + k, str(v).encode()) for k, v in (
                ("reason", cols["reason"][i] or ""), ("topic", cols["topic"][i]),
                ("partition", cols["partition"][i]), ("offset", cols["offset"][i]),
                ("deliveryCount", cols["deliveryCount"][i]), ("queryId", cols["queryId"][i] or ""),
                ("batchId", batch_id))]
            try:
                producer.produce(self.topic, key=cols["key"][i], value=cols["value"][i], headers=headers,
                                 on_delivery=delivered)
            except (KafkaException, BufferError) as e:
                errors.append(str(e))
                break
            producer.poll(0)
        left = producer.flush(60)
        if left:
            errors.append(f"{left} records not delivered within 60 s")
        if errors:
            raise DeadLetterError(f"writing {table.num_rows} rejected records to dead-letter topic {self.topic!r} "
                                  f"failed: {'; '.join(sorted(set(errors))[:3])}")
        return table.num_rows

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(30)
            self._producer = None
