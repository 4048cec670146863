"""``spark_share.driver.reads`` without Spark or Kafka: a slot's rows as the input partitions of a
readMode=driver batch, cut to fit a task payload and whole again on the executor."""
from __future__ import annotations

import pickle

import pyarrow as pa
import pytest

from spark_share.consumers import records
from spark_share.driver import reads as driver_reads
from spark_share.driver.reads import _pieces
from spark_share.partitions import RowsPartition


def slot_rows(n: int, value_bytes: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist(
        [{"key": None, "value": bytes([i % 251]) * value_bytes, "topic": "t", "partition": 0, "offset": i,
          "timestamp": None, "timestampType": 0, "deliveryCount": 1} for i in range(n)],
        schema=records.arrow_schema(False))


def test_a_slot_that_fits_is_one_partition_of_its_own_bytes_not_a_copy():
    ipc = records.to_ipc(slot_rows(10, 100))
    [piece] = _pieces(ipc)
    assert piece.address == ipc.address and piece.size == ipc.size  # the agent's cached rows, not copied
    # Rows another agent held come relayed through the tracker as bytes, not a pyarrow Buffer.
    assert [p.to_pybytes() for p in _pieces(ipc.to_pybytes())] == [ipc.to_pybytes()]
    assert [p.to_pybytes() for p in _pieces(bytearray(ipc.to_pybytes()))] == [ipc.to_pybytes()]


def test_a_big_slot_is_cut_into_pieces_under_the_bound_that_hold_every_row_once(monkeypatch):
    monkeypatch.setattr(driver_reads, "PARTITION_BYTES", 20_000)
    rows = slot_rows(500, 200)  # about 100 KB of values
    pieces = _pieces(records.to_ipc(rows))
    assert len(pieces) >= 5
    assert all(len(p) <= 20_000 + 2_000 for p in pieces)  # the bound, and one IPC header per piece
    offsets = [o for p in pieces for b in records.from_ipc(p) for o in b.column("offset").to_pylist()]
    assert offsets == list(range(500))


@pytest.mark.parametrize("protocol", [4, 5])  # PySpark pickles with 5; the rows come back as bytes either way
def test_the_partition_carries_its_rows_and_shows_no_bytes_in_its_repr(protocol):
    ipc = records.to_ipc(slot_rows(3, 10))  # the agent's buffer, as the driver hands it over
    part = pickle.loads(pickle.dumps(RowsPartition(4, 1, 0, ipc), protocol))
    assert type(part.ipc) is bytes and part.ipc == ipc.to_pybytes()
    assert [b.num_rows for b in records.from_ipc(part.ipc)] == [3]
    assert repr(part) == f"RowsPartition(batch=4, slot=1, piece=0, bytes={ipc.size})"
    assert pickle.loads(pickle.dumps(part, protocol)).ipc == part.ipc  # and bytes again, when Spark reruns it


def test_protocol_5_pickles_the_agents_buffer_itself_not_a_copy_of_it():
    ipc = records.to_ipc(slot_rows(3, 10))
    handed = []  # out of band, the pickler hands over the buffers it would write in band
    pickle.dumps(RowsPartition(4, 1, 0, ipc), 5, buffer_callback=handed.append)
    [view] = [b.raw() for b in handed]
    assert pa.py_buffer(view).address == ipc.address and view.nbytes == ipc.size and view.readonly
