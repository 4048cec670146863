"""The Kafka a test runs against: a fresh embedded broker per test (librdkafka's mock cluster), a real
Kafka >= 4.2 broker the harness starts for the session (from the Apache Kafka distribution at ``KAFKA_HOME``
with tests/harness/kafka_dist/start.sh, or from a start script of the user's, ``SPARK_SHARE_TEST_KAFKA_START``:
tests/harness/kafka_kit.py), or a Kafka >= 4.2 cluster of the user's when ``SPARK_SHARE_TEST_BOOTSTRAP`` is
set. ``./dev test`` runs the suite on the embedded broker, then on the real Kafka given, if any.

Owns: the one interface the tests use on either (``bootstrap_servers``, ``client()``, ``name()``,
``create_topic() -> the real name``, ``group() -> the real group id``, the share-group ``set_*``
settings), reading the two environment variables, and the skip of what only the embedded broker can
do (error injection, broker down/up, request tracking, per-test record-lock limits).

On an external cluster every topic and group a test names becomes ``spark-share-test-<8 hex>-<name>``
(one prefix per test): tests/harness/kafka_cluster.py creates, configures and deletes them, as it does for the
benchmark.

Must never: create, alter or delete a topic or group on an external cluster that it did not name
uniquely itself; print, or put in an error or a repr, a value of ``SPARK_SHARE_TEST_KAFKA_OPTIONS``
(it may hold credentials); wait on the cluster without a bound.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from harness.kafka_cluster import CleanupWarning, ClusterError, EmbeddedCluster, ExternalCluster, _reason  # noqa: F401 (CleanupWarning: for tests)
from harness.kafka_cluster import parse_options as _parse_options
from harness.kafka_kit import HOME_VAR, START_VAR, KitCluster, start_script
from spark_share.options import scrub

BOOTSTRAP_VAR = "SPARK_SHARE_TEST_BOOTSTRAP"
OPTIONS_VAR = "SPARK_SHARE_TEST_KAFKA_OPTIONS"
PREFIX = "spark-share-test"
REACHABLE_TIMEOUT_S = 10.0  # how long the session's first look at the cluster may take


class ClusterUnreachable(ClusterError):
    pass


def embedded_only(what: str):
    """Skip the calling test: it needs something only the embedded broker has."""
    pytest.skip(f"needs the embedded broker's {what}: not available on an external cluster")


EmbeddedBroker = EmbeddedCluster  # a fresh embedded broker per test


class ExternalKafka(ExternalCluster):
    """A cluster of the user's as one test sees it (its own prefix); what only the embedded broker can
    do skips the test. ``kit``: the broker the harness started (it can be restarted and killed), or
    None for a cluster of the user's."""

    def __init__(self, bootstrap_servers: str, options: Mapping[str, str] | None = None, prefix: str = PREFIX,
                 kit: KitCluster | None = None):
        try:
            super().__init__(bootstrap_servers, options, prefix)
        except ClusterError as e:  # the client refused the options: name where they came from
            raise ClusterError(f"{OPTIONS_VAR}: {e}") from None
        self.kit = kit

    def broker_kit(self) -> KitCluster:
        """The broker the harness started, to stop, kill and restart; skips the test on a cluster of yours."""
        if self.kit is None:
            pytest.skip(f"restarts or kills the broker: needs one the harness starts ({START_VAR}), not a cluster "
                        f"of yours ({BOOTSTRAP_VAR})")
        return self.kit

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


class _LastLine(logging.Handler):
    def __init__(self):
        super().__init__()
        self.line = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.line = record.getMessage()


# --- the mode switch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BrokerChoice:
    """Which Kafka the integration tests run against, from the environment."""

    bootstrap_servers: str | None = None  # None: a fresh embedded broker per test, or the kit's once started
    options: dict[str, str] = field(default_factory=dict, repr=False)  # may hold credentials
    start_script: str | None = None  # the harness starts a real broker from it (kafka_kit.start_script)
    kit: KitCluster | None = field(default=None, repr=False, compare=False)

    @property
    def external(self) -> bool:
        """A real Kafka: the kit's broker or a cluster of the user's."""
        return self.bootstrap_servers is not None or self.start_script is not None

    def describe(self) -> str:
        """One line for the session's start: the mode and the bootstrap, never an option's value."""
        if self.start_script is not None:
            return (f"spark-share brokers: a real Kafka broker started for this run from {self.start_script} "
                    f"({os.environ.get(HOME_VAR) or START_VAR}); tests that need the embedded broker are skipped")
        if not self.external:
            return (f"spark-share brokers: embedded (librdkafka's mock cluster, a fresh one per test); "
                    f"set {HOME_VAR} (an unpacked Apache Kafka >= 4.2) or {BOOTSTRAP_VAR} (a cluster of yours) "
                    "to run on a real broker")
        return (f"spark-share brokers: the external cluster {self.bootstrap_servers} ({BOOTSTRAP_VAR}), "
                f"{len(self.options)} client option(s) from {OPTIONS_VAR}; tests that need the embedded broker "
                "are skipped")

    def start(self) -> BrokerChoice:
        """With a start script: the same choice with the broker started (close it with ``stop()``)."""
        if self.start_script is None or self.kit is not None:
            return self
        kit = KitCluster(self.start_script).start()
        return BrokerChoice(kit.bootstrap_servers, self.options, self.start_script, kit)

    def stop(self) -> None:
        if self.kit is not None:
            self.kit.close()

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
        if not self.external:
            return EmbeddedBroker()
        assert self.bootstrap_servers, "start() the broker first"
        return ExternalKafka(self.bootstrap_servers, self.options, kit=self.kit)


def choose_broker(env: Mapping[str, str] = os.environ) -> BrokerChoice:
    """A cluster of yours (SPARK_SHARE_TEST_BOOTSTRAP) wins over a broker started here (SPARK_SHARE_TEST_KAFKA_START,
    else KAFKA_HOME with the project's start script)."""
    bootstrap = env.get(BOOTSTRAP_VAR, "").strip()
    if bootstrap:
        return BrokerChoice(bootstrap, parse_options(env.get(OPTIONS_VAR, "")))
    script = start_script(env)
    if script:
        if not os.path.isfile(script):
            raise ValueError(f"{START_VAR}={script}: no such file (a start script with the interface of "
                             f"tests/harness/kafka_dist/start.sh, or unset it and set {HOME_VAR})")
        return BrokerChoice(start_script=os.path.abspath(script))
    return BrokerChoice()


def parse_options(text: str) -> dict[str, str]:
    """SPARK_SHARE_TEST_KAFKA_OPTIONS: see tests/harness/kafka_cluster.py's ``parse_options``."""
    return _parse_options(text, OPTIONS_VAR, BOOTSTRAP_VAR)
