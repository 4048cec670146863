"""``spark_share.consumers.deadletter``: where REJECTed records are written before their REJECT.

Covers the Parquet-table target (one file per batch and slot under ``batchId=N``, in a ``tmp_path``,
read back with pyarrow: every original field kept, plus the reason, the query id, the time of the
reject, and the batch id as the table's partition column; no half-written file is ever visible), the
selection of the rejected rows out of a cached batch, the start-up checks (an unwritable
``deadLetterPath`` or a missing ``deadLetterTopic`` is refused naming the option), and the Kafka-topic
target against a fake ``confluent_kafka.Producer`` (the module builds it with ``Producer(conf)``,
monkeypatched here; no broker): an idempotent producer with ``acks=all``, the original headers kept
and the dead-letter fields added as ``spark-share.*`` headers, flushed before success is reported,
and a refused or unflushed write raised as ``DeadLetterError`` naming the topic.
"""
from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import confluent_kafka
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from spark_share.acknowledgement import REJECT
from spark_share.consumers import deadletter
from spark_share.consumers.deadletter import DeadLetterWriter, rejected_table
from spark_share.consumers.records import arrow_schema
from spark_share.deadletter_target import check_path, check_target
from spark_share.errors import DeadLetterError, SourceError
from spark_share.options import parse_options
from spark_share.verdict_set import VerdictSet

T0 = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


def cached_batch(n: int = 6, headers: bool = True, topic: str = "orders") -> pa.RecordBatch:
    """What an agent caches for one slot: n records of ``topic``, partitions 0 and 1 alternating."""
    rows = [{"key": f"k{i}".encode(), "value": f'{{"id": {i}}}'.encode(), "topic": topic, "partition": i % 2,
             "offset": 100 + i, "timestamp": T0, "timestampType": 0, "deliveryCount": 1 + i % 3,
             **({"headers": [{"key": "trace", "value": f"t{i}".encode()}]} if headers else {})}
            for i in range(n)]
    return pa.RecordBatch.from_pylist(rows, schema=arrow_schema(headers))


def rejects(reasons: dict) -> VerdictSet:
    """REJECT verdicts on (topic, partition, offset) -> reason."""
    return VerdictSet.from_records([(t, p, o, REJECT, why) for (t, p, o), why in reasons.items()])


def options(**extra: str):
    return parse_options({"kafka.bootstrap.servers": "broker:9092", "kafka.group.id": "g", "subscribe": "orders",
                          **extra})


# --- choosing the rejected rows ------------------------------------------------------------------------
def test_the_rejected_rows_keep_every_field_and_get_the_dead_letter_ones():
    b = cached_batch()
    t = rejected_table(b, rejects({("orders", 1, 101): "unparseable", ("orders", 0, 104): None, ("orders", 0, 999): "x"}),
                       "query-1", 7)
    assert t.num_rows == 2  # the record not in this batch is simply not there
    assert t.column_names == b.schema.names + ["reason", "queryId", "rejectedAt"]
    assert t.schema.field("rejectedAt").type == pa.timestamp("us", tz="UTC")
    rows = t.to_pylist()
    assert [(r["partition"], r["offset"], r["reason"], r["queryId"]) for r in rows] == [
        (1, 101, "unparseable", "query-1"), (0, 104, None, "query-1")]
    original = {(r["partition"], r["offset"]): r for r in b.to_pylist()}
    for r in rows:
        assert all(r[k] == v for k, v in original[(r["partition"], r["offset"])].items())


def test_nothing_rejected_in_a_slot_writes_nothing(tmp_path):
    w = DeadLetterWriter(None, str(tmp_path / "dlq"), {})
    assert w.write(rejected_table(cached_batch(), rejects({("orders", 0, 5): "x"}), "q", 0), 0, "slot0") == 0
    assert not (tmp_path / "dlq").exists()


# --- the Parquet-table target -----------------------------------------------------------------------
def test_the_table_gets_one_file_per_batch_and_slot_readable_by_pyarrow(tmp_path):
    path = tmp_path / "dlq"
    w = DeadLetterWriter(None, str(path), {})
    b = cached_batch()
    assert w.write(rejected_table(b, rejects({("orders", 0, 100): "bad", ("orders", 1, 103): "worse"}), "q-1", 3), 3,
                   "tr-slot0") == 2
    assert w.write(rejected_table(b, rejects({("orders", 0, 102): "bad"}), "q-1", 3), 3, "tr-slot1") == 1
    assert w.write(rejected_table(b, rejects({("orders", 1, 105): "late"}), "q-1", 4), 4, "tr-slot0") == 1
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["batchId=3/tr-slot0.parquet", "batchId=3/tr-slot1.parquet", "batchId=4/tr-slot0.parquet"]

    table = ds.dataset(str(path), format="parquet", partitioning="hive").to_table()
    rows = sorted(table.to_pylist(), key=lambda r: r["offset"])
    assert set(table.column_names) >= {"key", "value", "headers", "topic", "partition", "offset", "timestamp",
                                       "timestampType", "deliveryCount", "reason", "queryId", "rejectedAt",
                                       "batchId"}
    assert [(r["batchId"], r["topic"], r["partition"], r["offset"], r["deliveryCount"], r["reason"], r["queryId"])
            for r in rows] == [(3, "orders", 0, 100, 1, "bad", "q-1"), (3, "orders", 0, 102, 3, "bad", "q-1"),
                               (3, "orders", 1, 103, 1, "worse", "q-1"), (4, "orders", 1, 105, 3, "late", "q-1")]
    assert rows[0]["value"] == b'{"id": 0}' and rows[0]["headers"] == [{"key": "trace", "value": b"t0"}]
    assert rows[0]["timestamp"] == T0


def test_a_file_uri_path_is_the_same_table(tmp_path):
    w = DeadLetterWriter(None, f"file://{tmp_path / 'dlq'}", {})
    assert w.write(rejected_table(cached_batch(headers=False), rejects({("orders", 0, 100): "x"}), None, 0), 0, "s0") == 1
    assert pq.read_table(tmp_path / "dlq" / "batchId=0" / "s0.parquet").column("queryId").to_pylist() == [None]


def test_no_half_written_file_is_ever_visible(tmp_path, monkeypatch):
    """The file is written under a hidden temporary name and moved into place once closed."""
    seen = []
    real = pq.write_table

    def write_table(table, where, **kw):
        seen.append(where)
        real(table, where, **kw)
        assert not list((tmp_path / "dlq").rglob("*.parquet")), "the final name appeared before the write ended"
    monkeypatch.setattr(pq, "write_table", write_table)
    w = DeadLetterWriter(None, str(tmp_path / "dlq"), {})
    w.write(rejected_table(cached_batch(), rejects({("orders", 0, 100): "x"}), "q", 9), 9, "s0")
    assert [s.rsplit("/", 1)[1] for s in seen] == [".s0.parquet.tmp"]
    assert [p.name for p in (tmp_path / "dlq" / "batchId=9").iterdir()] == ["s0.parquet"]


# --- the checks when a query starts -----------------------------------------------------------------
def test_a_writable_path_passes_and_leaves_nothing_behind(tmp_path):
    check_path(str(tmp_path / "new" / "dlq"))
    assert (tmp_path / "new" / "dlq").is_dir() and not list((tmp_path / "new" / "dlq").iterdir())


def test_an_unwritable_path_is_refused_naming_the_option(tmp_path):
    (tmp_path / "a-file").write_text("in the way")
    target = str(tmp_path / "a-file" / "dlq")  # a directory can never be made under a file (root or not)
    with pytest.raises(DeadLetterError, match=r"option 'deadLetterPath' = '.*a-file/dlq' cannot be written") as e:
        check_path(target)
    assert "reachable from every executor" in str(e.value)


def test_check_target_checks_the_path_option(tmp_path):
    (tmp_path / "a-file").write_text("in the way")
    with pytest.raises(DeadLetterError, match="deadLetterPath"):
        check_target(options(deadLetterPath=str(tmp_path / "a-file" / "x")), metadata_client=None)
    check_target(options(deadLetterPath=str(tmp_path / "ok")), metadata_client=None)
    assert (tmp_path / "ok").is_dir()


class Metadata:
    def __init__(self, topics: dict):
        self.topics = topics
        self.asked = []

    def list_topics(self, topic=None, timeout=None):
        self.asked.append((topic, timeout))
        return SimpleNamespace(topics=self.topics)


def test_a_missing_dead_letter_topic_is_refused_naming_the_option():
    md = Metadata({"orders": SimpleNamespace(error=None)})
    with pytest.raises(SourceError, match=r"option 'deadLetterTopic' = 'dlq': the topic does not exist on "
                                          r"'broker:9092'; create it first"):
        check_target(options(deadLetterTopic="dlq"), md)
    assert md.asked == [("dlq", 30)]
    md.topics["dlq"] = SimpleNamespace(error="UNKNOWN_TOPIC_OR_PART")  # what a broker says of a topic it lacks
    with pytest.raises(SourceError, match="deadLetterTopic"):
        check_target(options(deadLetterTopic="dlq"), md)
    md.topics["dlq"] = SimpleNamespace(error=None)
    check_target(options(deadLetterTopic="dlq"), md)


# --- the Kafka-topic target, against a fake producer ------------------------------------------------------
class FakeProducer:
    """confluent_kafka.Producer as the writer uses it; delivery reports are served by flush()."""

    def __init__(self, conf: dict, fail_with=None, undelivered: int = 0, refuse_produce=None):
        self.conf = conf
        self.produced: list[dict] = []
        self.fail_with = fail_with
        self.undelivered = undelivered
        self.refuse_produce = refuse_produce
        self.pending = []
        self.flushed = []

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        if self.refuse_produce is not None:
            raise self.refuse_produce
        self.produced.append({"topic": topic, "key": key, "value": value, "headers": headers})
        self.pending.append(on_delivery)

    def poll(self, timeout):
        return 0

    def flush(self, timeout=None):
        self.flushed.append(timeout)
        for cb in self.pending:
            cb(self.fail_with, None)
        self.pending = []
        return self.undelivered

    def list_topics(self, topic=None, timeout=None):
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None)})


class KafkaErr:
    def __init__(self, name: str, code: int):
        self._name, self._code = name, code

    def name(self):
        return self._name

    def code(self):
        return self._code


@pytest.fixture
def producers(monkeypatch):
    made: list[FakeProducer] = []
    behaviour: dict = {}

    def factory(conf):
        made.append(FakeProducer(conf, **behaviour))
        return made[-1]
    monkeypatch.setattr(confluent_kafka, "Producer", factory)
    return made, behaviour


def test_the_topic_target_produces_each_record_with_its_fields_as_headers(producers):
    made, _ = producers
    w = DeadLetterWriter("dlq", None, {"bootstrap.servers": "broker:9092", "sasl.username": "u"})
    w.connect()
    t = rejected_table(cached_batch(), rejects({("orders", 1, 101): "unparseable", ("orders", 0, 102): None}), "q-1", 5)
    assert w.write(t, 5, "ignored-for-topics") == 2
    (p,) = made
    assert p.conf["enable.idempotence"] == "true" and p.conf["acks"] == "all"
    assert p.conf["bootstrap.servers"] == "broker:9092" and p.conf["sasl.username"] == "u"
    assert p.flushed, "success reported before the producer was flushed"
    first = p.produced[0]
    assert (first["topic"], first["key"], first["value"]) == ("dlq", b"k1", b'{"id": 1}')
    headers = dict(first["headers"])
    assert headers["trace"] == b"t1"  # the original headers are kept
    assert {k: v for k, v in headers.items() if k.startswith(deadletter.HEADER_PREFIX)} == {
        "spark-share.reason": b"unparseable", "spark-share.topic": b"orders", "spark-share.partition": b"1",
        "spark-share.offset": b"101", "spark-share.deliveryCount": b"2", "spark-share.queryId": b"q-1",
        "spark-share.batchId": b"5"}
    assert dict(p.produced[1]["headers"])["spark-share.reason"] == b""  # no reason given
    w.close()
    assert w._producer is None


def test_records_without_headers_get_only_the_dead_letter_headers(producers):
    made, _ = producers
    w = DeadLetterWriter("dlq", None, {})
    w.write(rejected_table(cached_batch(headers=False), rejects({("orders", 0, 100): "x"}), None, 0), 0, "s")
    assert all(k.startswith("spark-share.") for k, _ in made[0].produced[0]["headers"])
    assert dict(made[0].produced[0]["headers"])["spark-share.queryId"] == b""


@pytest.mark.parametrize("behaviour, expected", [
    ({"fail_with": KafkaErr("TOPIC_AUTHORIZATION_FAILED", 29)}, r"TOPIC_AUTHORIZATION_FAILED \(29\)"),
    ({"undelivered": 2}, "2 records not delivered within 60 s"),
    ({"refuse_produce": BufferError("Local: Queue full")}, "Queue full"),
])
def test_a_refused_or_unflushed_write_fails_naming_the_topic(producers, behaviour, expected):
    _, b = producers
    b.update(behaviour)
    w = DeadLetterWriter("dlq", None, {})
    t = rejected_table(cached_batch(), rejects({("orders", 0, 100): "x", ("orders", 1, 101): "y"}), "q", 1)
    with pytest.raises(DeadLetterError, match=rf"writing 2 rejected records to dead-letter topic 'dlq' failed: .*{expected}"):
        w.write(t, 1, "s")


def test_the_producer_is_opened_once_and_only_for_a_topic(producers, tmp_path):
    made, _ = producers
    w = DeadLetterWriter("dlq", None, {})
    w.connect()
    w.write(rejected_table(cached_batch(), rejects({("orders", 0, 100): "x"}), "q", 1), 1, "s")
    w.write(rejected_table(cached_batch(), rejects({("orders", 0, 102): "x"}), "q", 2), 2, "s")
    assert len(made) == 1 and len(made[0].produced) == 2
    DeadLetterWriter(None, str(tmp_path / "dlq"), {}).connect()
    assert len(made) == 1, "a path target needs no producer"
