"""What Spark carries to a read task: the input partitions of both read modes.

Owns: ``SharePartition`` (``readMode=executors``: where the tracker is and which (batch, slot) to read
through this executor's agent) and ``RowsPartition`` (``readMode=driver``: the rows themselves). Spark
pickles them into every task, so they live apart from driver/ and executor/, which both use them.

Must never: show the query's secret in a repr (plans, logs and Spark's UI print them), or hold anything
but plain data (they are unpickled on executors).
"""
from __future__ import annotations

import pickle

from pyspark.sql.datasource import InputPartition


class SharePartition(InputPartition):
    """One Spark task = one share consumer's single poll for one batch."""

    def __init__(self, tracker_host: str, tracker_port: int, tracker_id: str, secret: str, batch: int,
                 slot: int, max_records: int | None, poll_timeout_ms: int):
        super().__init__(None)
        self.tracker_host = tracker_host
        self.tracker_port = tracker_port
        self.tracker_id = tracker_id
        self.secret = secret
        self.batch = batch
        self.slot = slot
        self.max_records = max_records
        self.poll_timeout_ms = poll_timeout_ms

    def __repr__(self) -> str:  # the secret stays out of plans, logs and UIs
        return f"SharePartition(batch={self.batch}, slot={self.slot}, max_records={self.max_records})"

    __str__ = __repr__


class RowsPartition(InputPartition):
    """One Spark task of a ``readMode=driver`` batch: the rows themselves, as Arrow IPC. A task retry, a
    second action on the batch DataFrame or a lost executor gets these same rows from Spark."""

    def __init__(self, batch: int, slot: int, piece: int, ipc):
        """``ipc``: bytes, or on the driver any buffer (the agent's cached ``pyarrow.Buffer``)."""
        super().__init__(None)
        self.batch, self.slot, self.piece, self.ipc = batch, slot, piece, ipc

    def __reduce_ex__(self, protocol):
        # PySpark pickles with protocol 5, which writes a buffer's memory straight into the pickle: the rows are
        # not copied to bytes first (a copy of every byte read). Read-only, so that they come back as bytes.
        ipc = pickle.PickleBuffer(memoryview(self.ipc).toreadonly()) if protocol >= 5 else bytes(self.ipc)
        return RowsPartition, (self.batch, self.slot, self.piece, ipc)

    def __repr__(self) -> str:
        return f"RowsPartition(batch={self.batch}, slot={self.slot}, piece={self.piece}, bytes={len(self.ipc)})"

    __str__ = __repr__
