"""The Kafka the tests and the benchmark run against: a fresh embedded broker, or a Kafka >= 4.2
cluster of the user's (tests: ``SPARK_SHARE_TEST_BOOTSTRAP``; benchmark: ``--bootstrap-servers``),
where each creates what it needs under names of its own, and removes it.

Owns: unique names under one prefix per test or run, creating topics and setting share-group configs
through the Admin API (the embedded broker's cluster-wide knobs are per-group configs on Kafka 4.2),
deleting what it made, and the ``key=value;...`` / ``@FILE`` format of client options.

Must never: create, alter or delete a topic or group it did not name itself; put a client option's
value (credentials) in a repr, an error or a warning; wait on the cluster without a bound.
"""
from __future__ import annotations

import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeout

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    ResourceType,
)

from spark_share.embedded import EmbeddedKafka
from spark_share.options import scrub

ADMIN_TIMEOUT_S = 30.0  # every Admin API call's bound
PARTITIONS_PER_REQUEST = 5_000  # partitions one CreateTopics or CreatePartitions request makes (KRaft: at most 10,000 records)
MEMBERS_LEAVE_S = 15.0  # how long close() asks again to delete a group whose members are still leaving
MEMBERS_LEAVE_POLL_S = 0.5

# What the embedded broker's cluster-wide share-group knobs are on Kafka 4.2: per-group configs.
LOCK_DURATION = "share.record.lock.duration.ms"
DELIVERY_LIMIT = "share.delivery.count.limit"
SESSION_TIMEOUT = "share.session.timeout.ms"
HEARTBEAT_INTERVAL = "share.heartbeat.interval.ms"
AUTO_OFFSET_RESET = "share.auto.offset.reset"
RECORD_LOCKS = "share.partition.max.record.locks"  # a group config from Kafka 4.3 (KIP-1240)


class ClusterError(RuntimeError):
    """An Admin API call on the external cluster failed or had no answer in time."""


class CleanupWarning(UserWarning):
    """Something made on the external cluster could not be removed."""


def _until(done: Callable[[], bool], timeout: float, interval: float) -> None:
    """Poll ``done`` until it is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not done within {timeout:.0f} s")
        time.sleep(interval)


class EmbeddedCluster(EmbeddedKafka):
    """The embedded broker behind the same interface as ``ExternalCluster``. A fresh broker belongs to
    one test or benchmark run, so names are kept as they are."""

    external = False

    def name(self, name: str) -> str:
        return name

    def group(self, name: str) -> str:
        return name  # the broker's groups start at the earliest record (EmbeddedKafka's default)

    def client(self) -> dict[str, str]:
        return {"bootstrap.servers": self.bootstrap_servers}


class ExternalCluster:
    """A Kafka >= 4.2 cluster of the user's, as one test or benchmark run sees it: its own name prefix,
    the topics and groups it made (deleted by ``close()``), and the share-group configs it asked for."""

    external = True

    def __init__(self, bootstrap_servers: str, options: Mapping[str, str] | None = None, prefix: str = "spark-share"):
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
            raise ClusterError(self._text(f"the Kafka client refused the options: {_reason(e)}")) \
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
        # KRaft refuses a request that writes more than 10,000 metadata records ("excessively large batch
        # operation"), one per partition: a large topic is created, then grown, in steps.
        first = min(partitions, PARTITIONS_PER_REQUEST)
        futures = self._admin.create_topics([NewTopic(real, first, replication_factor)],
                                            request_timeout=ADMIN_TIMEOUT_S, operation_timeout=ADMIN_TIMEOUT_S)
        self._topics.append(real)  # deleted at close even if the answer is lost
        self._result(futures[real], f"creating topic {real} ({first} partitions)")
        for total in range(first + PARTITIONS_PER_REQUEST, partitions + PARTITIONS_PER_REQUEST, PARTITIONS_PER_REQUEST):
            total = min(total, partitions)
            grown = self._admin.create_partitions([NewPartitions(real, total)], request_timeout=ADMIN_TIMEOUT_S,
                                                  operation_timeout=ADMIN_TIMEOUT_S)
            self._result(grown[real], f"growing topic {real} to {total} partitions")
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

    def set_record_locks(self, locks: int) -> None:
        """Kafka >= 4.3 only (4.2 refuses the config): the group's record-lock budget per partition."""
        self._set_everywhere(RECORD_LOCKS, int(locks))

    # life cycle -------------------------------------------------------------------------------------
    def __enter__(self) -> ExternalCluster:
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
        """What could not be removed, one entry per topic, group or group's configs. Groups go first:
        Kafka 4.2 deletes a share group's state per topic, and for a topic already deleted the
        DeleteGroups answer took about 30 s to come, with UNKNOWN_TOPIC_OR_PART."""
        left = []
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
        if self._topics:
            errors = self._errors(self._admin.delete_topics(self._topics, request_timeout=ADMIN_TIMEOUT_S,
                                                            operation_timeout=ADMIN_TIMEOUT_S))
            left += [f"topic {t}: {_text(e)}" for t, e in errors.items()
                     if e is not None and _code(e) != KafkaError.UNKNOWN_TOPIC_OR_PART]
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
            _until(deleted, MEMBERS_LEAVE_S, MEMBERS_LEAVE_POLL_S)
        except AssertionError:
            pass  # reported with the groups' last answers
        return errors

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bootstrap_servers}, prefix {self.prefix}, {len(self._options)} client options)"

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
                            "group.share.min/max.* configs: see docs/testing.md, The test broker)")

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
            _until(visible, ADMIN_TIMEOUT_S, 0.2)
        except (AssertionError, KafkaException) as e:
            raise ClusterError(self._text(f"topic {topic} did not show {partitions} partitions with leaders in "
                                          f"{self.bootstrap_servers}'s metadata: {e}")) from None

    def _text(self, text: str) -> str:
        return scrub(text, list(self._options.values()))


def _reason(e: KafkaException) -> str:
    return _text(e.args[0]) if e.args else str(e)


def _text(error) -> str:
    return f"{error.name()}: {error.str()}" if isinstance(error, KafkaError) else str(error)


def _code(error) -> int | None:
    return error.code() if isinstance(error, KafkaError) else None


def parse_options(text: str, where: str, address_from: str) -> dict[str, str]:
    """``key=value`` entries (librdkafka names) separated by ``;`` or new lines, e.g.
    ``security.protocol=SASL_SSL;sasl.mechanism=PLAIN;sasl.username=u;sasl.password=p``; or ``@FILE``:
    the entries one per line in FILE (``#`` starts a comment line), for values that hold ``;``.
    Errors name the entry by its position, never by its text (it may be a credential)."""
    text = text.strip()
    if text.startswith("@"):
        path = text[1:].strip()
        try:
            with open(path) as f:
                lines = [ln for ln in f.read().splitlines() if not ln.strip().startswith("#")]
        except OSError as e:
            raise ValueError(f"{where}: cannot read {path}: {e.strerror}") from None
        entries, where = lines, f"{where} file {path}"
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
                             + (f"the cluster is {address_from}" if key == "bootstrap.servers"
                                else "each test or run names its own groups"))
        options[key] = value.strip()
    return options


def add_cluster_arguments(ap) -> None:
    """A benchmark's choice of Kafka: ``--kafka-start`` (a broker of the kit's interface it starts) or
    ``--bootstrap-servers`` (a cluster of yours), with ``--kafka-option`` client configs for the latter."""
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--kafka-start", help="a broker start script: tests/harness/kafka_dist/start.sh with KAFKA_HOME set "
                                             "to an unpacked Apache Kafka >= 4.2 (or a script with its interface)")
    where.add_argument("--bootstrap-servers", help="a Kafka >= 4.2 cluster of yours")
    ap.add_argument("--kafka-option", action="append", default=[], metavar="K=V",
                    help="a client config for your cluster; repeatable; @FILE reads them from FILE")


def cluster_options(ap, args) -> dict[str, str]:
    """The ``--kafka-option`` entries as one dict (an entry that does not parse ends the program via ``ap``)."""
    out: dict[str, str] = {}
    for i, o in enumerate(args.kafka_option, start=1):
        try:
            out.update(parse_options(o, f"--kafka-option number {i}", "--bootstrap-servers"))
        except ValueError as e:
            ap.error(str(e))
    return out
