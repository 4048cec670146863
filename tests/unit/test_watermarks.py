"""``spark_share.driver.watermarks``: the MetadataWatcher against a fake Kafka client.

``confluent_kafka.Consumer`` and ``confluent_kafka.admin.AdminClient`` are monkeypatched (the module
builds both from there); no broker. Covers the start-up check (a missing topic is an error naming it
and the topics that exist; an unreachable cluster errors within the given bound, from a client that
raises, without a real timeout; an authentication failure reported by the client's error callback
ends the wait at once; a bad client config is an error without the secret in it), the partitions
found, the high watermarks and their version, the background cadence (driven by a scripted stop
Event and a fake clock, no sleeping: a refresh every tick while ``wanted()``, otherwise every
BACKLOG_REFRESH_S, with ``on_refresh`` told each time and its failures contained), and the group's
limits from DescribeConfigs (``share_limits()``).
"""
from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import confluent_kafka
import confluent_kafka.admin
import pytest
from confluent_kafka import KafkaException

from spark_share.driver import watermarks
from spark_share.driver.watermarks import (
    BACKLOG_REFRESH_S,
    BROKER_LOCK_CONFIG,
    BROKER_SESSION_CONFIG,
    GROUP_LOCK_CONFIG,
    GROUP_RECORD_LOCKS_CONFIG,
    MAX_MEMBERS_CONFIG,
    RECORD_LOCKS_CONFIG,
    MetadataWatcher,
)
from spark_share.errors import SourceError
from spark_share.options import parse_options

SECRET = "pw-hunter2-xyz"


def topic(partitions: int, error=None):
    return SimpleNamespace(partitions={p: object() for p in range(partitions)}, error=error)


class Cluster:
    """What the fake clients see: topics, brokers, high watermarks, and faults to inject."""

    def __init__(self):
        self.topics = {"orders": topic(2), "audit": topic(1), "__consumer_offsets": topic(50)}
        self.brokers = {1: object(), 2: object()}
        self.high = {("orders", 0): 10, ("orders", 1): 20, ("audit", 0): 5}
        self.unreachable = False
        self.auth_error = None  # an error the client's error_cb is given on poll()
        self.bad_config: Exception | None = None
        self.watermark_errors: set = set()
        self.consumers: list[FakeConsumer] = []
        self.configs: dict = {}  # (ResourceType name, resource name) -> {config: value} or an Exception
        self.admins: list[FakeAdmin] = []


class FakeConsumer:
    def __init__(self, cluster: Cluster, conf: dict):
        if cluster.bad_config is not None:
            raise cluster.bad_config
        self.cluster, self.conf = cluster, conf
        self.list_calls: list[float] = []
        self.watermark_calls: list = []
        self.closed = False

    def list_topics(self, topic=None, timeout=None):
        self.list_calls.append(timeout)
        if self.cluster.unreachable:
            raise KafkaException(f"KafkaError{{code=_TRANSPORT,val=-195,str=\"Failed to get metadata: "
                                 f"Local: Broker transport failure (password {SECRET})\"}}")
        return SimpleNamespace(topics=dict(self.cluster.topics), brokers=dict(self.cluster.brokers))

    def poll(self, timeout):
        if self.cluster.auth_error is not None:
            self.conf["error_cb"](self.cluster.auth_error)

    def get_watermark_offsets(self, tp, timeout=None, cached=None):
        self.watermark_calls.append((tp.topic, tp.partition, timeout, cached))
        if (tp.topic, tp.partition) in self.cluster.watermark_errors:
            raise KafkaException("timed out")
        return 0, self.cluster.high[(tp.topic, tp.partition)]

    def close(self):
        self.closed = True


class FakeAdmin:
    def __init__(self, cluster: Cluster, conf: dict):
        self.cluster, self.conf = cluster, conf
        self.asked = []
        self.listed: list[tuple[int, float | None]] = []  # (partitions asked, request_timeout) per call

    def list_offsets(self, specs, request_timeout=None):
        self.listed.append((len(specs), request_timeout))
        out = {}
        for tp in specs:
            f: Future = Future()
            if (tp.topic, tp.partition) in self.cluster.watermark_errors:
                f.set_exception(KafkaException("timed out"))
            else:
                f.set_result(SimpleNamespace(offset=self.cluster.high[(tp.topic, tp.partition)]))
            out[tp] = f
        return out

    def describe_configs(self, resources, request_timeout=None):
        out = {}
        for r in resources:
            self.asked.append((r.restype.name, r.name))
            f: Future = Future()
            answer = self.cluster.configs.get((r.restype.name, r.name))
            if isinstance(answer, Exception) or answer is None:
                f.set_exception(answer or KafkaException("UNSUPPORTED_VERSION"))
            else:
                f.set_result({k: v if isinstance(v, SimpleNamespace) else SimpleNamespace(name=k, value=v)
                              for k, v in answer.items()})
            out[r] = f
        return out


@pytest.fixture
def cluster(monkeypatch):
    c = Cluster()

    def consumer(conf):
        c.consumers.append(FakeConsumer(c, conf))
        return c.consumers[-1]

    def admin(conf):
        c.admins.append(FakeAdmin(c, conf))
        return c.admins[-1]
    monkeypatch.setattr(confluent_kafka, "Consumer", consumer)
    monkeypatch.setattr(confluent_kafka.admin, "AdminClient", admin)
    return c


def options(topics: str = "orders,audit"):
    return parse_options({"kafka.bootstrap.servers": "broker:9092", "kafka.group.id": "orders-group",
                          "subscribe": topics, "kafka.sasl.password": SECRET, "kafka.sasl.username": "alice",
                          "kafka.max.poll.records": "500"})


@pytest.fixture
def watch(cluster):
    """A started watcher whose background thread refreshes nothing (``wanted`` is false); stopped after."""
    made = []

    def make(topics: str = "orders,audit", **kw) -> MetadataWatcher:
        kw.setdefault("wanted", lambda: False)
        made.append(MetadataWatcher(options(topics), timeout_s=5.0, **kw))
        return made[-1]
    yield make
    for w in made:
        w.close()


# --- the check at start ---------------------------------------------------------------------------
def test_start_finds_the_partitions_and_their_high_watermarks(cluster, watch):
    w = watch()
    assert w.partitions == [("audit", 0), ("orders", 0), ("orders", 1)]
    assert w.high == {("orders", 0): 10, ("orders", 1): 20, ("audit", 0): 5} and w.version == 1
    (c,) = cluster.consumers
    # A plain client, under a group of its own, with no share-consumer config.
    assert c.conf["group.id"] == "orders-group.spark-share-metadata" and c.conf["enable.auto.commit"] == "false"
    assert "max.poll.records" not in c.conf and c.conf["bootstrap.servers"] == "broker:9092"
    (admin,) = cluster.admins
    assert admin.listed == [(3, watermarks.REFRESH_TIMEOUT_S)], "one batched call for every partition"


def test_a_missing_topic_is_an_error_naming_it(cluster):
    with pytest.raises(SourceError) as e:
        MetadataWatcher(options("orders,nope"), timeout_s=5.0)
    msg = str(e.value)
    assert "topic(s) ['nope'] do not exist on 'broker:9092'; create them first" in msg
    assert "existing topics: ['audit', 'orders']" in msg  # internal topics are not offered
    assert cluster.consumers[0].closed


def test_a_topic_the_broker_reports_an_error_for_is_missing(cluster):
    cluster.topics["audit"] = topic(0, error="UNKNOWN_TOPIC_OR_PART")
    with pytest.raises(SourceError, match=r"\['audit'\] do not exist"):
        MetadataWatcher(options(), timeout_s=5.0)


def test_an_unreachable_cluster_errors_within_the_bound(cluster):
    cluster.unreachable = True
    with pytest.raises(SourceError) as e:
        MetadataWatcher(options(), timeout_s=0.3)
    msg = str(e.value)
    assert re.search(r"could not reach the Kafka cluster at kafka.bootstrap.servers='broker:9092' within \d+ s", msg)
    assert "Broker transport failure" in msg and SECRET not in msg
    c = cluster.consumers[0]
    assert c.closed
    assert c.list_calls and all(0.1 <= t <= watermarks.CONNECT_SLICE_S for t in c.list_calls), c.list_calls


def test_an_authentication_failure_ends_the_wait_at_once_and_says_so(cluster):
    cluster.unreachable = True
    cluster.auth_error = SimpleNamespace(code=lambda: -169, str=lambda: f"SASL authentication error (pw {SECRET})")
    with pytest.raises(SourceError) as e:
        MetadataWatcher(options(), timeout_s=3600)  # the bound is an hour: only the callback ends it
    msg = str(e.value)
    assert msg.startswith("authentication to the Kafka cluster at kafka.bootstrap.servers='broker:9092' failed "
                          "for user 'alice'")
    assert SECRET not in msg
    assert len(cluster.consumers[0].list_calls) == 1


def test_a_bad_client_config_is_an_error_without_the_secret(cluster):
    cluster.bad_config = KafkaException(f"Invalid value for sasl.password={SECRET}")
    with pytest.raises(SourceError, match="invalid Kafka client configuration") as e:
        MetadataWatcher(options(), timeout_s=5.0)
    assert SECRET not in str(e.value)


# --- refreshing the high watermarks ----------------------------------------------------------------
def test_the_version_moves_only_when_a_high_watermark_moved(cluster, watch):
    w = watch()
    w.refresh()
    assert w.version == 1
    cluster.high[("orders", 1)] = 25
    w.refresh()
    assert w.version == 2 and w.high[("orders", 1)] == 25


def test_a_partition_that_does_not_answer_keeps_its_value_and_is_named(cluster, watch):
    """One slow leader no longer ends the refresh for the partitions after it (they could drop out of a
    drain's target): every other partition is refreshed; the one that did not answer keeps its value."""
    w = watch()
    cluster.watermark_errors.add(("audit", 0))
    cluster.high[("orders", 0)] = 99
    assert w.refresh() == [("audit", 0)] and w.unanswered == [("audit", 0)]
    assert w.high[("orders", 0)] == 99 and w.high[("audit", 0)] == 5 and w.version == 2


def test_a_drains_target_waits_for_every_partition_or_fails_naming_them(cluster, monkeypatch):
    """The watermarks a drain reads up to: a partition that never answered is retried, and one that
    answers late joins the target; one that never does fails the drain with its name."""
    cluster.watermark_errors.add(("orders", 1))
    w = MetadataWatcher(options(), timeout_s=5.0, wanted=lambda: False)
    try:
        assert ("orders", 1) not in w.high and w.unanswered == [("orders", 1)]
        calls = []

        def refresh_then_answer():
            calls.append(1)
            if len(calls) == 2:
                cluster.watermark_errors.clear()
            return MetadataWatcher.refresh(w)
        monkeypatch.setattr(w, "refresh", refresh_then_answer)
        assert w.complete_high(timeout_s=30) == {("orders", 0): 10, ("orders", 1): 20, ("audit", 0): 5}
        cluster.watermark_errors.add(("audit", 0))
        w.high.pop(("audit", 0))
        with pytest.raises(SourceError, match=r"high watermarks of 1 partitions \(audit-0\) could not be read"):
            w.complete_high(timeout_s=0.2)
    finally:
        w.close()


class ScriptedStop:
    """Stands in for the watcher's stop Event: each wait() is one tick of the loop; it advances the
    fake clock by the interval waited and says "stopped" after ``ticks`` ticks."""

    def __init__(self, clock: list, ticks: int):
        self.clock, self.left, self.waits = clock, ticks, []

    def wait(self, timeout):
        self.waits.append(timeout)
        self.clock[0] += timeout
        self.left -= 1
        return self.left < 0

    def set(self):
        pass


def stop_thread(w: MetadataWatcher) -> None:
    """Stop the watcher's own thread: the test runs its loop instead."""
    w._stop.set()
    w._thread.join(5)
    assert not w._thread.is_alive()


def run_loop(w: MetadataWatcher, monkeypatch, ticks: int) -> ScriptedStop:
    """Run the watcher's loop here for ``ticks`` ticks on a fake clock (its thread stopped first)."""
    stop_thread(w)
    clock = [1000.0]
    monkeypatch.setattr(watermarks.time, "monotonic", lambda: clock[0])
    w._refreshed_at = clock[0]
    stop = ScriptedStop(clock, ticks)
    w._stop = stop  # type: ignore[assignment]
    w._loop()
    return stop


def test_while_wanted_every_tick_refreshes_and_tells_on_refresh(cluster, watch, monkeypatch):
    told = []
    wanted = threading.Event()
    w = watch(wanted=wanted.is_set, on_refresh=lambda: told.append(w.version))
    stop_thread(w)
    wanted.set()
    (admin,) = cluster.admins
    before = len(admin.listed)
    stop = run_loop(w, monkeypatch, ticks=4)
    assert stop.waits == [0.25] * 5  # the interval: at least 250 ms
    assert len(told) == 4 and len(admin.listed) == before + 4


def test_a_busy_stream_refreshes_only_every_backlog_refresh_s(cluster, watch, monkeypatch):
    told = []
    w = watch(on_refresh=lambda: told.append(1))  # wanted() is false: batches are not idle
    ticks = int(3 * BACKLOG_REFRESH_S / 0.25)
    run_loop(w, monkeypatch, ticks=ticks)
    assert len(told) == 3, f"{len(told)} refreshes in {ticks} ticks of 0.25 s"


def test_an_on_refresh_that_fails_does_not_stop_the_watermarks(cluster, watch, monkeypatch, caplog):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("estimate failed")
    wanted = threading.Event()
    w = watch(wanted=wanted.is_set, on_refresh=broken)
    stop_thread(w)
    wanted.set()
    cluster.high[("orders", 0)] = 11
    run_loop(w, monkeypatch, ticks=3)
    assert len(calls) == 3 and w.high[("orders", 0)] == 11
    assert "the backlog estimate failed" in caplog.text


def test_the_interval_keeps_refreshes_to_a_tenth_of_the_threads_time(cluster, watch, monkeypatch):
    w = watch()
    w._refresh_took = 0.5  # 10,000 partitions' refresh, on the embedded broker
    stop = run_loop(w, monkeypatch, ticks=0)
    assert stop.waits[0] == pytest.approx(5.0)


def test_close_stops_the_thread_and_closes_the_client(cluster, watch):
    w = watch()
    w.close()
    assert not w._thread.is_alive() and cluster.consumers[0].closed


# --- the group's limits ----------------------------------------------------------------------------
def test_share_limits_from_the_broker_and_the_group(cluster, watch):
    cluster.configs[("BROKER", "1")] = {RECORD_LOCKS_CONFIG: "2000", BROKER_LOCK_CONFIG: "30000"}
    cluster.configs[("GROUP", "orders-group")] = {GROUP_LOCK_CONFIG: "15000"}
    w = watch()
    assert w.share_limits(timeout_s=1) == (2000, 15000, None, None, None)
    (admin,) = cluster.admins
    assert admin.asked == [("BROKER", "1"), ("GROUP", "orders-group")]  # the first broker, then the group
    assert "group.id" not in admin.conf and SECRET in admin.conf.values(), "the admin client needs the credentials"
    # How long a lost member keeps its partitions (a replayed batch waits that long at most for its records).
    cluster.configs[("BROKER", "1")][BROKER_SESSION_CONFIG] = "45000"
    assert watch().share_limits(timeout_s=1).session_ms == 45000


def test_a_group_without_its_own_lock_gets_the_brokers_default(cluster, watch):
    cluster.configs[("BROKER", "1")] = {RECORD_LOCKS_CONFIG: "500", BROKER_LOCK_CONFIG: "30000",
                                        MAX_MEMBERS_CONFIG: "200"}
    cluster.configs[("GROUP", "orders-group")] = {GROUP_LOCK_CONFIG: ""}
    assert watch().share_limits(timeout_s=1) == (500, 30000, 200, None, None)
    cluster.configs.pop(("GROUP", "orders-group"))  # no permission to describe the group
    assert watch().share_limits(timeout_s=1) == (500, 30000, 200, None, None)


def test_a_groups_own_record_locks_come_before_the_brokers(cluster, watch):
    """Kafka 4.3+ (KIP-1240): share.partition.max.record.locks per group, within the broker's bounds. A value
    the broker reports as the default is not the group's own."""
    cluster.configs[("BROKER", "1")] = {RECORD_LOCKS_CONFIG: "2000", BROKER_LOCK_CONFIG: "30000"}
    cluster.configs[("GROUP", "orders-group")] = {GROUP_RECORD_LOCKS_CONFIG: "8000"}
    assert watch().share_limits(timeout_s=1) == (8000, 30000, None, None, 8000)
    cluster.configs[("GROUP", "orders-group")] = {
        GROUP_RECORD_LOCKS_CONFIG: SimpleNamespace(name=GROUP_RECORD_LOCKS_CONFIG, value="2000", is_default=True)}
    cluster.configs[("BROKER", "1")][RECORD_LOCKS_CONFIG] = "3000"
    assert watch().share_limits(timeout_s=1) == (3000, 30000, None, None, None)


def test_limits_the_cluster_does_not_say_are_none(cluster, watch):
    # The embedded broker does not implement DescribeConfigs (nor does a user without the permission).
    assert watch().share_limits(timeout_s=1) == (None, None, None, None, None)
    cluster.configs[("BROKER", "1")] = {RECORD_LOCKS_CONFIG: "many", BROKER_LOCK_CONFIG: "30000"}
    assert watch().share_limits(timeout_s=1) == (None, 30000, None, None, None)
    cluster.brokers = {}
    assert watch().share_limits(timeout_s=1) == (None, None, None, None, None)
