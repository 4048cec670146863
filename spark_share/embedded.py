"""An in-process Kafka broker with share groups: librdkafka's mock cluster, reached with ctypes.

Owns: loading the librdkafka shipped inside the confluent-kafka wheel, creating and destroying
one mock cluster, and the knobs tests need (share-group settings, error injection, broker
down/up, leader moves). It speaks the real Kafka wire protocol on loopback, so Spark executors
and any confluent-kafka client reach it through ``bootstrap_servers``.

Must never: be used in production (it keeps everything in memory and has the quirks listed in
docs/embedded-broker.md), or leave a cluster or its threads behind (``close`` is idempotent and runs on
``__exit__`` and on interpreter exit).
"""
from __future__ import annotations

import atexit
import ctypes
import glob
import os
import threading
from collections.abc import Iterable, Sequence

from .errors import ArgumentError, EmbeddedKafkaError

REQUIRED_CONFLUENT_KAFKA = "2.16.1"

# Kafka API keys of the share-group protocol, for error injection.
API_SHARE_GROUP_HEARTBEAT = 76
API_SHARE_FETCH = 78
API_SHARE_ACKNOWLEDGE = 79
API_KEYS = {"ShareGroupHeartbeat": 76, "ShareFetch": 78, "ShareAcknowledge": 79,
            "Produce": 0, "Fetch": 1, "ListOffsets": 2, "Metadata": 3,
            "FindCoordinator": 10}



def _find_librdkafka() -> str:
    try:
        import confluent_kafka
    except ImportError as e:  # pragma: no cover - dependency of the package
        raise EmbeddedKafkaError(
            f"confluent-kafka is not installed; pip install 'confluent-kafka>={REQUIRED_CONFLUENT_KAFKA}'") from e
    here = os.path.dirname(confluent_kafka.__file__)
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(here), "confluent_kafka.libs", "librdkafka*.so*")))
    candidates += sorted(glob.glob(os.path.join(here, ".dylibs", "librdkafka*.dylib")))
    if not candidates:
        raise EmbeddedKafkaError(
            "the librdkafka library bundled with confluent-kafka was not found next to "
            f"{here}; EmbeddedKafka needs the binary wheel of confluent-kafka>={REQUIRED_CONFLUENT_KAFKA} "
            "(a source build links the system librdkafka, which may lack the share-group mock)")
    return candidates[0]


_lib = None
_lib_lock = threading.Lock()

_SIGNATURES = {
    "rd_kafka_conf_new": ([], ctypes.c_void_p),
    "rd_kafka_conf_set": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int),
    "rd_kafka_conf_destroy": ([ctypes.c_void_p], None),
    "rd_kafka_new": ([ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_void_p),
    "rd_kafka_destroy": ([ctypes.c_void_p], None),
    "rd_kafka_mock_cluster_new": ([ctypes.c_void_p, ctypes.c_int], ctypes.c_void_p),
    "rd_kafka_mock_cluster_destroy": ([ctypes.c_void_p], None),
    "rd_kafka_mock_cluster_bootstraps": ([ctypes.c_void_p], ctypes.c_char_p),
    "rd_kafka_mock_topic_create": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "rd_kafka_mock_sharegroup_set_auto_offset_reset": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_record_lock_duration": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_max_delivery_attempts": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_session_timeout": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_heartbeat_interval": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_max_record_locks": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_sharegroup_set_max_size": ([ctypes.c_void_p, ctypes.c_int], None),
    "rd_kafka_mock_push_request_errors_array": ([ctypes.c_void_p, ctypes.c_int16, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)], None),
    "rd_kafka_mock_partition_push_request_errors": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int16, ctypes.c_size_t], None),
    "rd_kafka_mock_broker_push_request_error_rtts": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int16, ctypes.c_size_t], ctypes.c_int),
    "rd_kafka_mock_clear_request_errors": ([ctypes.c_void_p, ctypes.c_int16], None),
    "rd_kafka_mock_broker_set_down": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int),
    "rd_kafka_mock_broker_set_up": ([ctypes.c_void_p, ctypes.c_int32], ctypes.c_int),
    "rd_kafka_mock_partition_set_leader": ([ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int),
    "rd_kafka_mock_broker_set_rtt": ([ctypes.c_void_p, ctypes.c_int32, ctypes.c_int], ctypes.c_int),
    "rd_kafka_mock_start_request_tracking": ([ctypes.c_void_p], None),
    "rd_kafka_mock_get_requests": ([ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)], ctypes.POINTER(ctypes.c_void_p)),
    "rd_kafka_mock_request_api_key": ([ctypes.c_void_p], ctypes.c_int16),
    "rd_kafka_mock_request_destroy_array": ([ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], None),
}


def _load():
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = _find_librdkafka()
        lib = ctypes.CDLL(path)
        missing = []
        for name, (args, res) in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                missing.append(name)
                continue
            fn.argtypes = args
            fn.restype = res
        if missing:
            raise EmbeddedKafkaError(
                f"{os.path.basename(path)} lacks the share-group mock API ({', '.join(missing)}); "
                f"EmbeddedKafka needs confluent-kafka>={REQUIRED_CONFLUENT_KAFKA}: "
                f"pip install -U 'confluent-kafka>={REQUIRED_CONFLUENT_KAFKA}'")
        _lib = lib
        return lib


class EmbeddedKafka:
    """A mock Kafka cluster with share groups, alive between construction and ``close()``.

    >>> with EmbeddedKafka() as kafka:
    ...     kafka.create_topic("orders", 4)
    ...     kafka.bootstrap_servers
    """

    def __init__(self, brokers: int = 1, *, auto_offset_reset: str = "earliest",
                 record_lock_duration_ms: int | None = None,
                 max_delivery_attempts: int | None = None,
                 session_timeout_ms: int | None = None,
                 heartbeat_interval_ms: int | None = None):
        if brokers < 1:
            raise ArgumentError("brokers must be >= 1")
        self._lib = _load()
        self._lock = threading.Lock()
        self._rk = None
        self._mc = None
        self.brokers = brokers
        errstr = ctypes.create_string_buffer(512)
        conf = self._lib.rd_kafka_conf_new()
        # The handle only hosts the cluster; keep its own logging quiet.
        for k, v in (("log_level", "3"),):
            self._lib.rd_kafka_conf_set(conf, k.encode(), v.encode(), errstr, len(errstr))
        rk = self._lib.rd_kafka_new(0, conf, errstr, len(errstr))
        if not rk:
            self._lib.rd_kafka_conf_destroy(conf)
            raise EmbeddedKafkaError(f"could not create the librdkafka handle: {errstr.value.decode()}")
        self._rk = rk
        mc = self._lib.rd_kafka_mock_cluster_new(rk, brokers)
        if not mc:
            self._lib.rd_kafka_destroy(rk)
            self._rk = None
            raise EmbeddedKafkaError("rd_kafka_mock_cluster_new failed")
        self._mc = mc
        atexit.register(self.close)
        self.bootstrap_servers: str = self._lib.rd_kafka_mock_cluster_bootstraps(mc).decode()
        self.set_auto_offset_reset(auto_offset_reset)
        if record_lock_duration_ms is not None:
            self.set_record_lock_duration(record_lock_duration_ms)
        if max_delivery_attempts is not None:
            self.set_max_delivery_attempts(max_delivery_attempts)
        if session_timeout_ms is not None:
            self.set_session_timeout(session_timeout_ms)
        if heartbeat_interval_ms is not None:
            self.set_heartbeat_interval(heartbeat_interval_ms)

    # lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> EmbeddedKafka:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Destroy the cluster, then the handle that hosts it. Idempotent."""
        with self._lock:
            mc, rk = self._mc, self._rk
            self._mc = self._rk = None
        if mc:
            self._lib.rd_kafka_mock_cluster_destroy(mc)
        if rk:
            self._lib.rd_kafka_destroy(rk)
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover
            pass

    @property
    def running(self) -> bool:
        return self._mc is not None

    def _cluster(self):
        mc = self._mc
        if not mc:
            raise EmbeddedKafkaError("the embedded broker is closed")
        return mc

    # topics ----------------------------------------------------------------------------
    def create_topic(self, name: str, partitions: int = 1, replication_factor: int = 1) -> str:
        """Creates ``name`` and returns it (as a cluster of yours returns the unique name it chose)."""
        err = self._lib.rd_kafka_mock_topic_create(self._cluster(), name.encode(), partitions,
                                                   min(replication_factor, self.brokers))
        if err:
            raise EmbeddedKafkaError(f"could not create topic {name!r}: error code {err}")
        return name

    # share-group settings (cluster-wide in the mock; session timeout and heartbeat apply to
    # groups created afterwards) ---------------------------------------------------------
    def set_auto_offset_reset(self, reset: str) -> None:
        if reset not in ("earliest", "latest"):
            raise ArgumentError("auto_offset_reset must be 'earliest' or 'latest'")
        self._lib.rd_kafka_mock_sharegroup_set_auto_offset_reset(self._cluster(), 1 if reset == "earliest" else 0)

    def set_record_lock_duration(self, ms: int) -> None:
        self._lib.rd_kafka_mock_sharegroup_set_record_lock_duration(self._cluster(), int(ms))

    def set_max_delivery_attempts(self, attempts: int) -> None:
        self._lib.rd_kafka_mock_sharegroup_set_max_delivery_attempts(self._cluster(), int(attempts))

    def set_session_timeout(self, ms: int) -> None:
        self._lib.rd_kafka_mock_sharegroup_set_session_timeout(self._cluster(), int(ms))

    def set_max_record_locks(self, locks: int) -> None:
        """Records of one partition a share group may hold acquired at once (Kafka's
        group.share.partition.max.record.locks, 2000 by default): the cap on a batch's size."""
        self._lib.rd_kafka_mock_sharegroup_set_max_record_locks(self._cluster(), int(locks))

    def set_heartbeat_interval(self, ms: int) -> None:
        self._lib.rd_kafka_mock_sharegroup_set_heartbeat_interval(self._cluster(), int(ms))

    def set_max_members(self, members: int) -> None:
        """Members a share group may have (Kafka's group.share.max.size, 200 by default; 0: no limit): a
        consumer joining a full group gets GROUP_MAX_SIZE_REACHED, a fatal error, as on Kafka."""
        self._lib.rd_kafka_mock_sharegroup_set_max_size(self._cluster(), int(members))

    # error injection -------------------------------------------------------------------
    @staticmethod
    def _api_key(api) -> int:
        if isinstance(api, str):
            try:
                return API_KEYS[api]
            except KeyError:
                raise ArgumentError(f"unknown API {api!r}; known: {sorted(API_KEYS)} or a numeric key") from None
        return int(api)

    def push_request_errors(self, api, errors: Sequence[int]) -> None:
        """The next ``len(errors)`` requests of ``api`` (any broker) fail with these error codes."""
        arr = (ctypes.c_int * len(errors))(*errors)
        self._lib.rd_kafka_mock_push_request_errors_array(self._cluster(), self._api_key(api), len(errors), arr)

    def push_partition_request_errors(self, topic: str, partition: int, api, errors: Sequence[int]) -> None:
        """Errors returned for ``topic``/``partition`` in the next requests of ``api``."""
        extra = [ctypes.c_int(e) for e in errors]
        self._lib.rd_kafka_mock_partition_push_request_errors(
            self._cluster(), topic.encode(), partition, self._api_key(api), len(errors), *extra)

    def push_broker_request_errors(self, broker_id: int, api, errors_rtts: Iterable[tuple[int, int]]) -> None:
        """The next requests of ``api`` to one broker answer with (error code, delay ms)."""
        pairs = list(errors_rtts)
        extra = []
        for err, rtt in pairs:
            extra += [ctypes.c_int(err), ctypes.c_int(rtt)]
        rc = self._lib.rd_kafka_mock_broker_push_request_error_rtts(
            self._cluster(), broker_id, self._api_key(api), len(pairs), *extra)
        if rc:
            raise EmbeddedKafkaError(f"could not inject errors on broker {broker_id}: error code {rc}")

    def clear_request_errors(self, api) -> None:
        self._lib.rd_kafka_mock_clear_request_errors(self._cluster(), self._api_key(api))

    def track_requests(self) -> None:
        """Record every request the brokers receive from now on (see ``request_count``)."""
        self._lib.rd_kafka_mock_start_request_tracking(self._cluster())

    def request_count(self, api) -> int:
        """Requests of ``api`` received since ``track_requests()``, from any client: tells a test
        that the errors it injected were served."""
        n = ctypes.c_size_t()
        reqs = self._lib.rd_kafka_mock_get_requests(self._cluster(), ctypes.byref(n))
        if not reqs:
            return 0
        try:
            key = self._api_key(api)
            return sum(1 for i in range(n.value) if self._lib.rd_kafka_mock_request_api_key(reqs[i]) == key)
        finally:
            self._lib.rd_kafka_mock_request_destroy_array(reqs, n.value)

    # brokers ---------------------------------------------------------------------------
    def broker_down(self, broker_id: int) -> None:
        self._check(self._lib.rd_kafka_mock_broker_set_down(self._cluster(), broker_id), f"broker {broker_id} down")

    def broker_up(self, broker_id: int) -> None:
        self._check(self._lib.rd_kafka_mock_broker_set_up(self._cluster(), broker_id), f"broker {broker_id} up")

    def set_broker_rtt(self, broker_id: int, rtt_ms: int) -> None:
        self._check(self._lib.rd_kafka_mock_broker_set_rtt(self._cluster(), broker_id, rtt_ms), "broker rtt")

    def move_leader(self, topic: str, partition: int, broker_id: int) -> None:
        self._check(self._lib.rd_kafka_mock_partition_set_leader(self._cluster(), topic.encode(), partition, broker_id),
                    f"leader of {topic}-{partition} -> {broker_id}")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc:
            raise EmbeddedKafkaError(f"{what} failed: error code {rc}")

    def __repr__(self) -> str:
        state = self.bootstrap_servers if self.running else "closed"
        return f"EmbeddedKafka(brokers={self.brokers}, {state})"


def parse_topic_spec(spec: str) -> tuple[str, int]:
    """``orders:4`` -> ("orders", 4); ``orders`` -> ("orders", 1)."""
    name, _, parts = spec.partition(":")
    if not name:
        raise ArgumentError(f"bad topic {spec!r}: expected NAME or NAME:PARTITIONS")
    try:
        n = int(parts) if parts else 1
    except ValueError:
        raise ArgumentError(f"bad topic {spec!r}: PARTITIONS must be an integer") from None
    if n < 1:
        raise ArgumentError(f"bad topic {spec!r}: PARTITIONS must be >= 1")
    return name, n
