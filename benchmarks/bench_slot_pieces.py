"""readMode=driver's hand-over of a slot's rows to Spark, on one core: the source runner cuts the slot's Arrow
IPC into partitions of at most 16 MiB and PySpark pickles each (protocol 5). The way it is done (the agent's
buffer pickled as it is; a big slot cut into zero-copy slices, each written once) beside the way it was
(each piece copied to bytes first; a big slot's slices combined, then written, then copied). No Spark, no
broker: the rows are made here.

    .venv/bin/python benchmarks/bench_slot_pieces.py

It must never time the making of the rows, only the cutting and pickling; the best of a few repeats is
taken, so a busy machine's pauses do not count.
"""
from __future__ import annotations

import time


def copied_pieces(ipc, records, limit: int) -> list[bytes]:
    """The hand-over before: every piece copied to bytes, a big slot's slices combined first."""
    import pyarrow as pa

    if ipc.size <= limit:
        return [ipc.to_pybytes()]
    batches = records.from_ipc(ipc)
    rows = sum(b.num_rows for b in batches)
    table = pa.Table.from_batches(batches)
    n = -(-ipc.size // limit)
    step = -(-rows // n)
    return [records.to_ipc(table.slice(i, step).combine_chunks().to_batches()[0]).to_pybytes()
            for i in range(0, rows, step)]


def slot(n: int, value_bytes: int):
    import pyarrow as pa

    from spark_share.consumers import records

    cols = [pa.nulls(n, pa.binary()), pa.array([bytes([i % 251]) * value_bytes for i in range(n)], pa.binary()),
            pa.repeat(pa.scalar("orders"), n), pa.array([0] * n, pa.int32()), pa.array(range(n), pa.int64()),
            pa.nulls(n, pa.timestamp("us", tz="UTC")), pa.array([0] * n, pa.int32()), pa.array([1] * n, pa.int32())]
    return records.to_ipc(pa.RecordBatch.from_arrays(cols, schema=records.arrow_schema(False)))


def main(repeats: int = 5) -> None:
    from pyspark import cloudpickle

    from spark_share.consumers import records
    from spark_share.driver import reads
    from spark_share.partitions import RowsPartition

    def cost_ms(ipc, cut) -> float:
        best = float("inf")
        for _ in range(repeats):
            c0 = time.process_time()
            blobs = [cloudpickle.dumps(RowsPartition(1, 0, i, p), 5) for i, p in enumerate(cut(ipc))]
            best = min(best, time.process_time() - c0)
            del blobs
        return best * 1000

    print(f"{'a slot':<36} | {'copied (ms)':>11} | {'as it is (ms)':>13} | ratio")
    for n, value_bytes in ((8_000, 1000), (40_000, 1000), (4_000, 10_000)):
        ipc = slot(n, value_bytes)
        before = cost_ms(ipc, lambda b: copied_pieces(b, records, reads.PARTITION_BYTES))
        now = cost_ms(ipc, reads._pieces)
        what = f"{n:,} records of {value_bytes:,} B ({ipc.size / 1e6:.0f} MB)"
        print(f"{what:<36} | {before:11.1f} | {now:13.1f} | {now / before:.2f}", flush=True)


if __name__ == "__main__":
    main()
