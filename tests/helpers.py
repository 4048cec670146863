"""Small test helpers: a bounded wait, a long-lived producer of records with unique ids, and
ctypes access to the embedded broker's share-group membership (member ids, manual assignment).

Nothing here sleeps to synchronise: ``wait_until`` polls a predicate with a deadline.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import time
from collections.abc import Iterable, Sequence


def wait_until(predicate, timeout: float, interval: float = 0.05, message: str = "condition not met"):
    """Call ``predicate`` until it returns something truthy (returned) or ``timeout`` s pass
    (AssertionError naming ``message``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{message} (waited {timeout} s)")
        time.sleep(interval)  # polling interval of a bounded wait, not synchronisation


class ProducerPool:
    """One long-lived confluent-kafka Producer per broker for the life of a test.

    With the embedded broker, ANY client disconnecting ends every share session on that broker
    (locked records of other consumers are released and delivered again), so a test must not
    create and drop producers while share consumers are working. ``close()`` at the end of the
    test flushes and drops them, before the broker itself goes away (a producer outliving its
    broker could otherwise reconnect to a later test's broker that reuses the port)."""

    def __init__(self):
        self._producers: dict[str, object] = {}
        self._ids = itertools.count()

    def producer(self, kafka):
        from confluent_kafka import Producer

        bootstrap = kafka if isinstance(kafka, str) else kafka.bootstrap_servers
        p = self._producers.get(bootstrap)
        if p is None:
            p = self._producers[bootstrap] = Producer({"bootstrap.servers": bootstrap, "linger.ms": 2, "log_level": 2})
        return p

    def produce(self, kafka, topic: str, values_or_count: int | Iterable, partitions: int | None = None,
                timeout: float = 30.0) -> list[int]:
        """Produce records with ids unique within the test: value = JSON with an ``id`` field,
        key = the id. ``values_or_count`` is a count or an iterable of values (dicts get an ``id``
        unless they have one; anything else is stored under ``value``). ``partitions=N`` spreads
        the records round-robin over partitions 0..N-1 (else the key decides). Flushes; returns
        the ids in production order."""
        p = self.producer(kafka)
        values = [None] * values_or_count if isinstance(values_or_count, int) else list(values_or_count)
        ids = []
        for i, v in enumerate(values):
            if isinstance(v, dict) and "id" in v:
                rid = v["id"]
                body = v
            else:
                rid = next(self._ids)
                body = {"id": rid, **v} if isinstance(v, dict) else ({"id": rid} if v is None else {"id": rid, "value": v})
            kwargs = {} if partitions is None else {"partition": i % partitions}
            while True:
                try:
                    p.produce(topic, key=str(rid).encode(), value=json.dumps(body).encode(), **kwargs)
                    break
                except BufferError:
                    p.poll(0.1)
            ids.append(rid)
        left = p.flush(timeout)
        assert left == 0, f"{left} records not delivered to {topic} within {timeout} s"
        return ids

    __call__ = produce

    def close(self) -> None:
        for p in self._producers.values():
            p.flush(5)
        self._producers.clear()


# --- share-group membership of the embedded broker ----------------------------------------
class ShareGroups:
    """Member ids and manual target assignment of the embedded broker's share groups.

    The mock's own assignor gives each partition to ONE member. ``assign`` calls
    ``rd_kafka_mock_sharegroup_target_assignment`` to put a partition on several members (what
    a real broker does); it switches the group to manual assignment for good. It goes through
    its own ctypes handle on the library EmbeddedKafka loaded, so EmbeddedKafka's function
    prototypes are untouched."""

    _lib = None

    def __init__(self, kafka):
        self.kafka = kafka
        if ShareGroups._lib is None:
            from spark_share.embedded import _find_librdkafka, _load

            _load()  # the same checks (and error message) as EmbeddedKafka
            lib = ctypes.CDLL(_find_librdkafka())
            PP_char = ctypes.POINTER(ctypes.POINTER(ctypes.c_char_p))
            for name, args, res in (
                ("rd_kafka_mock_sharegroup_get_member_ids",
                 [ctypes.c_void_p, ctypes.c_char_p, PP_char, ctypes.POINTER(ctypes.c_size_t)], ctypes.c_int),
                ("rd_kafka_mock_sharegroup_target_assignment",
                 [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p),
                  ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], None),
                ("rd_kafka_topic_partition_list_new", [ctypes.c_int], ctypes.c_void_p),
                ("rd_kafka_topic_partition_list_add", [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32],
                 ctypes.c_void_p),
                ("rd_kafka_topic_partition_list_destroy", [ctypes.c_void_p], None),
                ("rd_kafka_mem_free", [ctypes.c_void_p, ctypes.c_void_p], None),
            ):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            ShareGroups._lib = lib
        self.lib = ShareGroups._lib

    def _mc(self):
        mc = self.kafka._mc
        assert mc, "the embedded broker is closed"
        return mc

    def members(self, group: str) -> list[str]:
        """Member ids of ``group`` ([] if the group does not exist yet)."""
        arr = ctypes.POINTER(ctypes.c_char_p)()
        n = ctypes.c_size_t()
        rc = self.lib.rd_kafka_mock_sharegroup_get_member_ids(self._mc(), group.encode(), ctypes.byref(arr),
                                                             ctypes.byref(n))
        if rc:  # GROUP_ID_NOT_FOUND
            return []
        out = [arr[i].decode() for i in range(n.value)]
        if n.value:
            raw = ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p))
            for i in range(n.value):
                self.lib.rd_kafka_mem_free(None, raw[i])
            self.lib.rd_kafka_mem_free(None, ctypes.cast(arr, ctypes.c_void_p))
        return out

    def assign(self, group: str, assignment: dict[str, Sequence[tuple[str, int]]]) -> None:
        """Give each member id exactly the (topic, partition)s listed (freezes the group's assignment)."""
        ids = list(assignment)
        lists = []
        try:
            for m in ids:
                tpl = self.lib.rd_kafka_topic_partition_list_new(max(1, len(assignment[m])))
                lists.append(tpl)
                for topic, part in assignment[m]:
                    self.lib.rd_kafka_topic_partition_list_add(tpl, topic.encode(), part)
            self.lib.rd_kafka_mock_sharegroup_target_assignment(
                self._mc(), group.encode(), (ctypes.c_char_p * len(ids))(*[m.encode() for m in ids]),
                (ctypes.c_void_p * len(ids))(*lists), len(ids))
        finally:
            for tpl in lists:
                self.lib.rd_kafka_topic_partition_list_destroy(tpl)
