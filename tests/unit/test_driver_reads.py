"""``spark_share.driver.reads`` without Spark or Kafka: a slot's rows as the input partitions of a
readMode=driver batch, cut to fit a task payload and whole again on the executor."""
from __future__ import annotations

import pickle

import pyarrow as pa

from spark_share.consumers import records
from spark_share.driver import reads as driver_reads
from spark_share.driver.reads import _pieces
from spark_share.partitions import RowsPartition


def slot_rows(n: int, value_bytes: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"key": None, "value": bytes([i % 251]) * value_bytes, "topic": "t", "partition": 0, "offset": i,
          "timestamp": None, "timestampType": 0, "deliveryCount": 1} for i in range(n)],
        schema=records.arrow_schema(False))


def test_a_slot_that_fits_is_one_partition_of_its_own_bytes():
    ipc = records.to_ipc(slot_rows(10, 100))
    assert _pieces(ipc) == [ipc.to_pybytes()]
    # Rows another agent held come relayed through the tracker as bytes, not a pyarrow Buffer.
    assert _pieces(ipc.to_pybytes()) == _pieces(bytearray(ipc.to_pybytes())) == [ipc.to_pybytes()]


def test_a_big_slot_is_cut_into_pieces_under_the_bound_that_hold_every_row_once(monkeypatch):
    monkeypatch.setattr(driver_reads, "PARTITION_BYTES", 20_000)
    rows = slot_rows(500, 200)  # about 100 KB of values
    pieces = _pieces(records.to_ipc(rows))
    assert len(pieces) >= 5
    assert all(len(p) <= 20_000 + 2_000 for p in pieces)  # the bound, and one IPC header per piece
    offsets = [o for p in pieces for b in records.from_ipc(p) for o in b.column("offset").to_pylist()]
    assert offsets == list(range(500))


def test_the_partition_carries_its_rows_and_shows_no_bytes_in_its_repr():
    ipc = records.to_ipc(slot_rows(3, 10)).to_pybytes()
    part = pickle.loads(pickle.dumps(RowsPartition(4, 1, 0, ipc)))
    assert [b.num_rows for b in records.from_ipc(part.ipc)] == [3]
    assert repr(part) == f"RowsPartition(batch=4, slot=1, piece=0, bytes={len(ipc)})"
