"""The Kafka a test runs against: a fresh embedded broker per test (librdkafka's mock cluster, what CI
runs), or a Kafka >= 4.2 cluster of the user's when ``SPARK_SHARE_TEST_BOOTSTRAP`` is set.

Owns: the one interface the tests use on either (``bootstrap_servers``, ``client()``, ``name()``,
``create_topic() -> the real name``, ``group() -> the real group id``, the share-group ``set_*``
settings), reading the two environment variables, and the skip of what only the embedded broker can
do (error injection, broker down/up, request tracking, per-test record-lock limits).

On an external cluster every topic and group a test names becomes ``spark-share-test-<8 hex>-<name>``
(one prefix per test); topics are created and group configs set through the Admin API, and
``close()`` deletes the topics and groups it made.

Must never: create, alter or delete a topic or group on an external cluster that it did not name
uniquely itself; print, or put in an error or a repr, a value of ``SPARK_SHARE_TEST_KAFKA_OPTIONS``
(it may hold credentials); wait on the cluster without a bound.
"""
from __future__ import annotations

import logging
import os
import uuid
import warnings
from collections.abc import Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from spark_share.embedded import EmbeddedKafka
from spark_share.options import scrub
from support import wait_until

BOOTSTRAP_VAR = "SPARK_SHARE_TEST_BOOTSTRAP"
OPTIONS_VAR = "SPARK_SHARE_TEST_KAFKA_OPTIONS"
PREFIX = "spark-share-test"
ADMIN_TIMEOUT_S = 30.0  # every Admin API call's bound
MEMBERS_LEAVE_S = 15.0  # how long close() asks again to delete a group whose members are still leaving
MEMBERS_LEAVE_POLL_S = 0.5
REACHABLE_TIMEOUT_S = 10.0  # how long the session's first look at the cluster may take

# What the embedded broker's cluster-wide share-group knobs are on Kafka 4.2: per-group configs.
LOCK_DURATION = "share.record.lock.duration.ms"
DELIVERY_LIMIT = "share.delivery.count.limit"
SESSION_TIMEOUT = "share.session.timeout.ms"
HEARTBEAT_INTERVAL = "share.heartbeat.interval.ms"
AUTO_OFFSET_RESET = "share.auto.offset.reset"


class ClusterError(RuntimeError):
    """An Admin API call on the external cluster failed or had no answer in time."""


class ClusterUnreachable(ClusterError):
    pass


class CleanupWarning(UserWarning):
    """Something a test made on the external cluster could not be removed after it."""


def embedded_only(what: str):
    """Skip the calling test: it needs something only the embedded broker has."""
    pytest.skip(f"needs the embedded broker's {what}: not available on an external cluster")


class EmbeddedBroker(EmbeddedKafka):
    """The embedded broker with the interface the tests use on either kind of cluster. A fresh broker
    belongs to one test, so names are kept as they are."""

    external = False

    def name(self, name: str) -> str:
        return name

    def create_topic(self, name: str, partitions: int = 1, replication_factor: int = 1) -> str:  # type: ignore
        super().create_topic(name, partitions, replication_factor)
        return name

    def group(self, name: str) -> str:
        return name  # the broker's groups start at the earliest record (EmbeddedKafka's default)

    def client(self) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap_servers}


class ExternalKafka:
    """A Kafka >= 4.2 cluster of the user's, as one test sees it: its own name prefix, the topics and
    groups it made (deleted by ``close()``), and the share-group configs the test asked for."""

    external = True

    def __init__(self, bootstrap_servers: str, options: Mapping[str, str] | None = None, prefix: str = PREFIX):
        self.bootstrap_servers = bootstrap_servers
        self._options = dict(options or {})
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self._topics: list[str] = []
        self._groups: dict[str, str] = {}  # the test's name -> the real group id
        self._group_configs: dict[str, str] = {}  # asked for so far: applied to every group, declared or to come
        self._closed = False
        try:
            self._admin = AdminClient(self.client())
        except KafkaException as e:  # e.g. an unknown option or a bad value: librdkafka quotes the value
            raise ClusterError(self._text(f"{OPTIONS_VAR}: the Kafka client refused the options: {_reason(e)}")) \
                from None

    # names, topics, groups -------------------------------------------------------------------------
    def client(self) -> dict[str, str]:
        """Client configs for any producer, consumer or admin client of the test (credentials included)."""
        return {"bootstrap.servers": self.bootstrap_servers, **self._options}

    def name(self, name: str) -> str:
        """The real name of the test's ``name``, for a topic or group this object does not create or
        configure (a topic that must not exist, a classic consumer's group)."""
        return f"{self.prefix}-{name}"

    def create_topic(self, name: str, partitions: int = 1, replication_factor: int = -1) -> str:
        """Creates the topic under its real name (returned); replication -1: the broker's default."""
        real = self.name(name)
        futures = self._admin.create_topics([NewTopic(real, partitions, replication_factor)],
                                            request_timeout=ADMIN_TIMEOUT_S, operation_timeout=ADMIN_TIMEOUT_S)
        self._topics.append(real)  # deleted at close even if the answer is lost
        self._result(futures[real], f"creating topic {real} ({partitions} partitions)")
        self._wait_until_visible(real, partitions)
        return real

    def group(self, name: str) -> str:
        """The real id of the test's share group ``name``, set to start at the earliest record and to
        every share-group setting asked for so far (the same id for the same name)."""
        real = self._groups.get(name)
        if real is None:
            real = self._groups[name] = self.name(name)
            self._set_group_configs(real, {AUTO_OFFSET_RESET: "earliest", **self._group_configs})
        return real

    # share-group settings: per group on Kafka 4.2, for every group declared so far and to come ------
    def set_auto_offset_reset(self, reset: str) -> None:
        self._set_everywhere(AUTO_OFFSET_RESET, reset)

    def set_record_lock_duration(self, ms: int) -> None:
        self._set_everywhere(LOCK_DURATION, int(ms))

    def set_max_delivery_attempts(self, attempts: int) -> None:
        self._set_everywhere(DELIVERY_LIMIT, int(attempts))

    def set_session_timeout(self, ms: int) -> None:
        self._set_everywhere(SESSION_TIMEOUT, int(ms))

    def set_heartbeat_interval(self, ms: int) -> None:
        self._set_everywhere(HEARTBEAT_INTERVAL, int(ms))

    def set_max_record_locks(self, locks: int) -> None:
        embedded_only("per-test record lock limit (group.share.partition.max.record.locks is a broker config "
                      "on Kafka 4.2)")

    # what only the embedded broker can do ------------------------------------------------------------
    def push_request_errors(self, api, errors) -> None:
        embedded_only("error injection")

    def push_partition_request_errors(self, topic, partition, api, errors) -> None:
        embedded_only("error injection")

    def push_broker_request_errors(self, broker_id, api, errors_rtts) -> None:
        embedded_only("error injection")

    def clear_request_errors(self, api) -> None:
        embedded_only("error injection")

    def broker_down(self, broker_id: int) -> None:
        embedded_only("broker down/up")

    def broker_up(self, broker_id: int) -> None:
        embedded_only("broker down/up")

    def set_broker_rtt(self, broker_id: int, rtt_ms: int) -> None:
        embedded_only("broker latency injection")

    def move_leader(self, topic: str, partition: int, broker_id: int) -> None:
        embedded_only("leader moves")

    def track_requests(self) -> None:
        embedded_only("request tracking")

    def request_count(self, api) -> int:
        embedded_only("request tracking")
        return 0  # not reached: skip raises

    # life cycle -------------------------------------------------------------------------------------
    def __enter__(self) -> ExternalKafka:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Deletes the topics, groups and group configs this test made. What cannot be removed is
        reported as a CleanupWarning, never raised: a test's own failure must stay what the run reports."""
        if self._closed:
            return
        self._closed = True
        try:
            left = self._remove_all()
        except Exception as e:  # an Admin call refused outright: report it like any other leftover
            left = [f"cleanup stopped: {type(e).__name__}: {_reason(e) if isinstance(e, KafkaException) else e}"]
        if left:
            warnings.warn(CleanupWarning(self._text(f"left on {self.bootstrap_servers}: " + "; ".join(left))),
                          stacklevel=2)

    def _remove_all(self) -> list[str]:
        """What could not be removed, one entry per topic, group or group's configs."""
        left = []
        if self._topics:
            errors = self._errors(self._admin.delete_topics(self._topics, request_timeout=ADMIN_TIMEOUT_S,
                                                            operation_timeout=ADMIN_TIMEOUT_S))
            left += [f"topic {t}: {_text(e)}" for t, e in errors.items()
                     if e is not None and _code(e) != KafkaError.UNKNOWN_TOPIC_OR_PART]
        groups = list(self._groups.values())
        if groups:
            errors = self._delete_groups(groups)
            left += [f"group {g}: {_text(e)}" for g, e in errors.items()
                     if e is not None and _code(e) != KafkaError.GROUP_ID_NOT_FOUND]
            keys = [AUTO_OFFSET_RESET, *self._group_configs]
            resources = [ConfigResource(ResourceType.GROUP, g, incremental_configs=[
                ConfigEntry(k, None, incremental_operation=AlterConfigOpType.DELETE) for k in keys]) for g in groups]
            errors = self._errors(self._admin.incremental_alter_configs(resources, request_timeout=ADMIN_TIMEOUT_S))
            left += [f"group {r.name}'s configs: {_text(e)}" for r, e in errors.items() if e is not None]
        return left

    def _delete_groups(self, groups: list[str]) -> dict:
        """Each group's error (None: deleted). A group whose members are still leaving (the consumers
        of a query that just stopped) is asked for again, for at most MEMBERS_LEAVE_S."""
        errors: dict = {}
        pending = groups

        def deleted() -> bool:
            nonlocal pending
            answers = self._errors(self._admin.delete_consumer_groups(pending, request_timeout=ADMIN_TIMEOUT_S))
            errors.update(answers)
            pending = [g for g, e in answers.items() if _code(e) == KafkaError.NON_EMPTY_GROUP]
            return not pending

        try:
            wait_until(deleted, MEMBERS_LEAVE_S, interval=MEMBERS_LEAVE_POLL_S)
        except AssertionError:
            pass  # reported with the groups' last answers
        return errors

    def __repr__(self) -> str:
        return f"ExternalKafka({self.bootstrap_servers}, prefix {self.prefix}, {len(self._options)} client options)"

    # the Admin API, bounded, its errors scrubbed -----------------------------------------------------
    def _set_everywhere(self, key: str, value) -> None:
        self._group_configs[key] = str(value)
        for real in self._groups.values():
            self._set_group_configs(real, {key: str(value)})

    def _set_group_configs(self, group: str, configs: Mapping[str, str]) -> None:
        entries = [ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in configs.items()]
        resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)
        asked = ", ".join(f"{k}={v}" for k, v in configs.items())
        for f in self._admin.incremental_alter_configs([resource], request_timeout=ADMIN_TIMEOUT_S).values():
            self._result(f, f"setting share group {group}'s {asked} (the broker bounds these values with its "
                            "group.share.min/max.* configs: see the README, Tests)")

    def _result(self, future, what: str):
        try:
            return future.result(timeout=ADMIN_TIMEOUT_S)
        except FutureTimeout:
            raise ClusterError(f"{what}: no answer from {self.bootstrap_servers} within {ADMIN_TIMEOUT_S:.0f} s") \
                from None
        except KafkaException as e:
            raise ClusterError(self._text(f"{what}: {_reason(e)}")) from None

    @staticmethod
    def _errors(futures) -> dict:
        """Each key's outcome: None (done), its KafkaError, or why there is none."""
        out = {}
        for key, f in futures.items():
            try:
                f.result(timeout=ADMIN_TIMEOUT_S)
                out[key] = None
            except FutureTimeout:
                out[key] = f"no answer within {ADMIN_TIMEOUT_S:.0f} s"
            except KafkaException as e:
                out[key] = e.args[0] if e.args else str(e)
        return out

    def _wait_until_visible(self, topic: str, partitions: int) -> None:
        """Until every partition of a new topic has a leader in the metadata (a source started right
        after the creation checks the topic at once)."""
        def visible() -> bool:
            t = self._admin.list_topics(topic=topic, timeout=5).topics.get(topic)
            return (t is not None and t.error is None and len(t.partitions) == partitions
                    and all(p.leader >= 0 for p in t.partitions.values()))

        try:
            wait_until(visible, ADMIN_TIMEOUT_S, interval=0.2)
        except (AssertionError, KafkaException) as e:
            raise ClusterError(self._text(f"topic {topic} did not show {partitions} partitions with leaders in "
                                          f"{self.bootstrap_servers}'s metadata: {e}")) from None

    def _text(self, text: str) -> str:
        return scrub(text, list(self._options.values()))


class _LastLine(logging.Handler):
    def __init__(self):
        super().__init__()
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.line = record.getMessage()


def _reason(e: KafkaException) -> str:
    return _text(e.args[0]) if e.args else str(e)


def _text(error) -> str:
    return f"{error.name()}: {error.str()}" if isinstance(error, KafkaError) else str(error)


def _code(error) -> int | None:
    return error.code() if isinstance(error, KafkaError) else None


# --- the mode switch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BrokerChoice:
    """Which Kafka the integration tests run against, from the environment."""

    bootstrap_servers: str | None = None  # None: a fresh embedded broker per test
    options: dict[str, str] = field(default_factory=dict, repr=False)  # may hold credentials

    @property
    def external(self) -> bool:
        return self.bootstrap_servers is not None

    def describe(self) -> str:
        """One line for the session's start: the mode and the bootstrap, never an option's value."""
        if not self.external:
            return (f"spark-share brokers: embedded (librdkafka's mock cluster, a fresh one per test); "
                    f"set {BOOTSTRAP_VAR} to run against a Kafka >= 4.2 cluster of yours")
        return (f"spark-share brokers: the external cluster {self.bootstrap_servers} ({BOOTSTRAP_VAR}), "
                f"{len(self.options)} client option(s) from {OPTIONS_VAR}; tests that need the embedded broker "
                "are skipped")

    def check_reachable(self) -> None:
        """Fails within about REACHABLE_TIMEOUT_S, naming the variable, when no broker answers. The
        client's log (a line per failed connection attempt) is kept, not printed: its last line goes
        into the error, which says why (refused, TLS, SASL)."""
        if not self.external:
            return
        log = _LastLine()
        logger = logging.Logger("spark-share-tests.reachable")
        logger.addHandler(log)
        try:
            admin = AdminClient({**self.client(), "logger": logger})
        except KafkaException as e:  # an unknown option or a bad value: librdkafka quotes the value
            raise ClusterError(self._text(f"{OPTIONS_VAR}: the Kafka client refused the options: {_reason(e)}")) \
                from None
        try:
            admin.list_topics(timeout=REACHABLE_TIMEOUT_S)
        except KafkaException as e:
            admin.poll(0)  # serves the log lines queued meanwhile
            said = f"; the client's last log line: {log.line}" if log.line else ""
            raise ClusterUnreachable(self._text(
                f"{BOOTSTRAP_VAR}={self.bootstrap_servers}: the cluster did not answer within "
                f"{REACHABLE_TIMEOUT_S:.0f} s ({_reason(e)}{said}); check the address and the client options in "
                f"{OPTIONS_VAR} (security protocol, credentials)")) from None

    def client(self) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap_servers or "", **self.options}

    def _text(self, text: str) -> str:
        return scrub(text, list(self.options.values()))

    def open(self) -> EmbeddedBroker | ExternalKafka:
        """The broker of one test: close it (or use it as a context manager) after the test."""
        return ExternalKafka(self.bootstrap_servers, self.options) if self.external else EmbeddedBroker()


def choose_broker(env: Mapping[str, str] = os.environ) -> BrokerChoice:
    bootstrap = env.get(BOOTSTRAP_VAR, "").strip()
    if not bootstrap:
        return BrokerChoice()
    return BrokerChoice(bootstrap, parse_options(env.get(OPTIONS_VAR, "")))


def parse_options(text: str) -> dict[str, str]:
    """``key=value`` entries (librdkafka names) separated by ``;`` or new lines, e.g.
    ``security.protocol=SASL_SSL;sasl.mechanism=PLAIN;sasl.username=u;sasl.password=p``; or ``@FILE``:
    the entries one per line in FILE (``#`` starts a comment line), for values that hold ``;``.
    Errors name the entry by its position, never by its text (it may be a credential)."""
    text = text.strip()
    where = OPTIONS_VAR
    if text.startswith("@"):
        path = text[1:].strip()
        try:
            with open(path) as f:
                lines = [ln for ln in f.read().splitlines() if not ln.strip().startswith("#")]
        except OSError as e:
            raise ValueError(f"{OPTIONS_VAR}: cannot read {path}: {e.strerror}") from None
        entries, where = lines, f"{OPTIONS_VAR} file {path}"
    else:
        entries = text.replace("\n", ";").split(";")
    options: dict[str, str] = {}
    for i, entry in enumerate((e for e in entries if e.strip()), start=1):
        key, eq, value = entry.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"{where}: entry {i} is not key=value (entries are separated by ';')")
        if key.startswith("kafka."):
            raise ValueError(f"{where}: entry {i} ({key}): write librdkafka's name, without 'kafka.'")
        if key in ("bootstrap.servers", "group.id"):
            raise ValueError(f"{where}: entry {i} ({key}): "
                             + (f"the cluster is {BOOTSTRAP_VAR}" if key == "bootstrap.servers"
                                else "each test names its own groups"))
        options[key] = value.strip()
    return options
