
import pytest

from spark_share import spark_versions
from spark_share.consumers import records


class Msg:
    def __init__(self, topic, partition, offset, key, value, ts=(1, 1_700_000_000_123), count=1, headers=None, err=None):
        self._t, self._p, self._o, self._k, self._v, self._ts, self._c, self._h, self._e = (
            topic, partition, offset, key, value, ts, count, headers, err)

    def topic(self): return self._t
    def partition(self): return self._p
    def offset(self): return self._o
    def key(self): return self._k
    def value(self): return self._v
    def timestamp(self): return self._ts
    def delivery_count(self): return self._c
    def headers(self): return self._h
    def error(self): return self._e


def test_schema_matches_spark_and_rows_convert():
    msgs = [Msg("t", 0, 5, b"k", b"v", count=2), Msg("t", 1, 7, None, None, ts=(0, -1)), Msg("u", 0, 1, b"", b"x" * (1 << 20))]
    rb, acquired = records.to_record_batch(msgs, include_headers=False)
    assert rb.schema == records.ARROW_SCHEMA
    rows = rb.to_pylist()
    assert rows[0]["key"] == b"k" and rows[0]["deliveryCount"] == 2 and rows[0]["timestampType"] == 0
    assert rows[0]["timestamp"].timestamp() == 1_700_000_000.123
    assert rows[1]["key"] is None and rows[1]["value"] is None and rows[1]["timestamp"] is None
    assert rows[1]["timestampType"] == -1
    assert len(rows[2]["value"]) == 1 << 20 and rows[2]["key"] == b""
    assert acquired == {"t": {0: [[5, 5]], 1: [[7, 7]]}, "u": {0: [[1, 1]]}}


def test_acquired_offsets_are_exact_sorted_runs_per_partition():
    offs = [(0, 4), (1, 9), (0, 2), (0, 3), (1, 10), (0, 7), (0, 8), (1, 8)]  # out of order, with gaps
    msgs = [Msg("t" if p == 0 else "u", p, o, b"k", b"v") for p, o in offs]
    _, acquired = records.to_record_batch(msgs, include_headers=False)
    assert acquired == {"t": {0: [[2, 4], [7, 8]]}, "u": {1: [[8, 10]]}}


def test_headers():
    hs = [(f"h{i}", f"v{i}".encode()) for i in range(50)] + [("nullvalue", None)]
    msgs = [Msg("t", 0, 1, b"k", b"v", headers=hs), Msg("t", 0, 2, b"k", b"v", headers=None)]
    rb, acquired = records.to_record_batch(msgs, include_headers=True)
    assert rb.schema == records.ARROW_SCHEMA_HEADERS
    rows = rb.to_pylist()
    assert len(rows) == 2 and len(rows[0]["headers"]) == 51 and rows[0]["headers"][3] == {"key": "h3", "value": b"v3"}
    assert rows[0]["headers"][50] == {"key": "nullvalue", "value": None} and rows[1]["headers"] == []
    assert acquired == {"t": {0: [[1, 2]]}}


def test_ipc_round_trip_including_empty():
    rb, _ = records.to_record_batch([Msg("t", 0, 1, b"k", b"v")], False)
    assert records.from_ipc(records.to_ipc(rb))[0].equals(rb)
    empty, _ = records.to_record_batch([], False)
    assert sum(b.num_rows for b in records.from_ipc(records.to_ipc(empty))) == 0


def test_a_missing_delivery_count_is_null():
    rb, _ = records.to_record_batch([Msg("t", 0, 1, b"k", b"v", count=None), Msg("t", 0, 2, b"k", b"v")], False)
    assert rb.column("deliveryCount").to_pylist() == [None, 1]


def test_a_single_topic_consumer_gets_the_same_batch_without_asking_each_message():
    msgs = [Msg("t", p, o, b"k", b"v") for p, o in ((0, 1), (0, 2), (1, 5))]
    rb, acquired = records.to_record_batch(msgs, False)
    rb1, acquired1 = records.to_record_batch(msgs, False, topic="t")
    assert rb1.equals(rb) and acquired1 == acquired == {"t": {0: [[1, 2]], 1: [[5, 5]]}}


@pytest.mark.parametrize("headers", [False, True])
def test_the_schema_with_an_exchange_location_is_the_ddl_schema_with_the_location_on_offset(headers):
    from spark_share.options import EXCHANGE_METADATA, parse_options
    from spark_share.source import KafkaShareDataSource

    base = {"kafka.bootstrap.servers": "b:9092", "kafka.group.id": "g", "subscribe": "t",
            "includeHeaders": str(headers).lower()}
    assert KafkaShareDataSource(base).schema() == records.spark_schema(headers)  # unchanged without the option
    struct = KafkaShareDataSource(dict(base, exchangeLocation="/Volumes/a/b/c")).schema()
    if not spark_versions.SCHEMA_METADATA:  # Spark < 4.2 fails a query whose source's schema has metadata
        assert struct == records.spark_schema(headers)
        return
    ddl = records.spark_schema(headers).replace("long", "bigint").replace("array<struct<key: string, value: binary>>",
                                                                          "array<struct<key:string,value:binary>>")
    assert struct.simpleString() == "struct<" + ",".join(f.replace(" ", ":", 1) for f in ddl.split(", ")) + ">"
    assert struct["offset"].metadata == {EXCHANGE_METADATA: "/Volumes/a/b/c"}
    assert all(not f.metadata for f in struct.fields if f.name != "offset")
    assert parse_options(dict(base, exchangeLocation="/Volumes/a/b/c")).exchange_location == "/Volumes/a/b/c"
