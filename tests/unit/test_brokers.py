"""tests/harness/brokers.py (and tests/harness/kafka_cluster.py under it) without a broker: the external-cluster mode against a fake Admin client (what it asks
the cluster to create, configure and delete), the embedded-only skips, and the mode switch."""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AlterConfigOpType, ResourceType

from harness import brokers
from harness import kafka_cluster as clusters
from harness.brokers import (
    BOOTSTRAP_VAR,
    OPTIONS_VAR,
    CleanupWarning,
    ClusterError,
    ClusterUnreachable,
    EmbeddedBroker,
    ExternalKafka,
    choose_broker,
    parse_options,
)
from spark_share.embedded import EmbeddedKafka

SECRET = "pa55-w0rd;with=signs"
OPTIONS = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "alice",
           "sasl.password": SECRET}


def done(value=None) -> Future:
    f = Future()
    f.set_result(value)
    return f


def failed(code: int, text: str) -> Future:
    f = Future()
    f.set_exception(KafkaException(KafkaError(code, text)))
    return f


class FakeAdmin:
    """Records what the cluster is asked. ``answers`` maps (call, name) to the Future to answer instead
    of success, or to a list of them, one per call (the last one stays)."""

    def __init__(self, conf):
        self.conf = conf
        self.created: list[tuple[str, int, int]] = []
        self.configs: list[tuple[str, dict[str, str]]] = []
        self.removed_configs: list[tuple[str, list[str]]] = []
        self.deleted_topics: list[str] = []
        self.deleted_groups: list[str] = []
        self.answers: dict[tuple[str, str], Future | list[Future]] = {}
        FakeAdmin.last = self

    def answer(self, call: str, name: str) -> Future:
        a = self.answers.get((call, name), done())
        return (a.pop(0) if len(a) > 1 else a[0]) if isinstance(a, list) else a

    def create_topics(self, new_topics, **kwargs):
        assert kwargs["operation_timeout"] and kwargs["request_timeout"]
        self.created += [(t.topic, t.num_partitions, t.replication_factor) for t in new_topics]
        return {t.topic: self.answer("create", t.topic) for t in new_topics}

    def list_topics(self, topic=None, timeout=-1):
        n = {name: parts for name, parts, _ in self.created}.get(topic)
        partitions = {i: SimpleNamespace(leader=1) for i in range(n or 0)}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)} if n else {})

    def incremental_alter_configs(self, resources, **kwargs):
        out = {}
        for r in resources:
            assert r.restype == ResourceType.GROUP
            (op,) = {e.incremental_operation for e in r.incremental_configs}
            if op == AlterConfigOpType.SET:
                self.configs.append((r.name, {e.name: e.value for e in r.incremental_configs}))
            else:
                assert op == AlterConfigOpType.DELETE
                self.removed_configs.append((r.name, [e.name for e in r.incremental_configs]))
            out[r] = self.answer("alter", r.name)
        return out

    def delete_topics(self, topics, **kwargs):
        self.deleted_topics += topics
        return {t: self.answer("delete", t) for t in topics}

    def delete_consumer_groups(self, groups, **kwargs):
        self.deleted_groups += groups
        return {g: self.answer("delete", g) for g in groups}


@pytest.fixture
def admin(monkeypatch):
    monkeypatch.setattr(brokers, "AdminClient", FakeAdmin)
    monkeypatch.setattr(clusters, "AdminClient", FakeAdmin)
    return lambda: FakeAdmin.last


def test_topics_get_names_unique_to_the_test_and_the_brokers_replication(admin):
    a, b = ExternalKafka("b:9092", OPTIONS), ExternalKafka("b:9092", OPTIONS)
    assert admin().conf == {"bootstrap.servers": "b:9092", **OPTIONS}  # the Admin client has the credentials too
    name = b.create_topic("orders", 4)
    assert name.startswith("spark-share-test-") and name.endswith("-orders") and name == b.name("orders")
    assert a.name("orders") != name, "two tests share a topic name"
    assert admin().created == [(name, 4, -1)]
    assert b.client() == {"bootstrap.servers": "b:9092", **OPTIONS}


def test_a_topic_that_does_not_show_in_the_metadata_is_an_error(admin, monkeypatch):
    monkeypatch.setattr(clusters, "ADMIN_TIMEOUT_S", 0.3)
    k = ExternalKafka("b:9092")
    admin().list_topics = lambda topic=None, timeout=-1: SimpleNamespace(topics={})
    with pytest.raises(ClusterError, match=r"did not show 2 partitions with leaders"):
        k.create_topic("late", 2)
    assert k._topics == [k.name("late")], "a topic whose creation was asked is deleted after the test"


def test_each_group_starts_at_earliest_with_every_setting_asked_so_far(admin):
    k = ExternalKafka("b:9092")
    k.set_record_lock_duration(5000)
    g1 = k.group("g-1")
    assert g1 == k.name("g-1") and k.group("g-1") == g1  # one name, one group
    k.set_max_delivery_attempts(3)
    g2 = k.group("g-2")
    k.set_session_timeout(6000)
    k.set_heartbeat_interval(1000)
    assert admin().configs == [
        (g1, {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": "5000"}),
        (g1, {"share.delivery.count.limit": "3"}),
        (g2, {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": "5000",
              "share.delivery.count.limit": "3"}),
        (g1, {"share.session.timeout.ms": "6000"}), (g2, {"share.session.timeout.ms": "6000"}),
        (g1, {"share.heartbeat.interval.ms": "1000"}), (g2, {"share.heartbeat.interval.ms": "1000"}),
    ]
    assert admin().created == [] and k.name("reader") not in {g for g, _ in admin().configs}


def test_a_setting_the_broker_refuses_names_the_group_the_config_and_the_value(admin):
    k = ExternalKafka("b:9092", OPTIONS)
    g = k.group("g")
    admin().answers[("alter", g)] = failed(KafkaError.INVALID_CONFIG, "share.record.lock.duration.ms must be greater "
                                           "than or equal to group.share.min.record.lock.duration.ms")
    with pytest.raises(ClusterError) as e:
        k.set_record_lock_duration(3000)
    text = str(e.value)
    assert g in text and "share.record.lock.duration.ms=3000" in text and "INVALID_CONFIG" in text
    assert "group.share.min.record.lock.duration.ms" in text  # the broker's own reason


def test_close_deletes_what_the_test_made_and_reports_what_it_could_not(admin, monkeypatch):
    monkeypatch.setattr(clusters, "MEMBERS_LEAVE_S", 0.2)
    monkeypatch.setattr(clusters, "MEMBERS_LEAVE_POLL_S", 0.01)
    k = ExternalKafka("b:9092", OPTIONS)
    t1, t2 = k.create_topic("a"), k.create_topic("b")
    g1, g2, g3, g4 = k.group("g1"), k.group("g2"), k.group("g3"), k.group("g4")
    k.set_record_lock_duration(5000)
    fake = admin()
    busy = failed(KafkaError.NON_EMPTY_GROUP, "members left")
    fake.answers[("delete", t2)] = failed(KafkaError.TOPIC_AUTHORIZATION_FAILED, f"denied ({SECRET})")
    fake.answers[("delete", g2)] = failed(KafkaError.GROUP_ID_NOT_FOUND, "never joined")  # nothing to remove
    fake.answers[("delete", g3)] = busy  # its members never leave
    fake.answers[("delete", g4)] = [busy, busy, done()]  # its members leave after two tries
    with pytest.warns(CleanupWarning) as w:
        with k:
            pass
    assert fake.deleted_topics == [t1, t2]
    assert fake.deleted_groups[:4] == [g1, g2, g3, g4] and set(fake.deleted_groups[4:]) == {g3, g4}
    assert fake.deleted_groups.count(g4) == 3 and fake.deleted_groups.count(g3) > 3
    keys = ["share.auto.offset.reset", "share.record.lock.duration.ms"]
    assert fake.removed_configs == [(g, keys) for g in (g1, g2, g3, g4)]
    (report,) = [str(x.message) for x in w]
    assert f"topic {t2}: TOPIC_AUTHORIZATION_FAILED" in report and f"group {g3}: NON_EMPTY_GROUP" in report
    assert t1 not in report and g2 not in report and g4 not in report and SECRET not in report
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.close()  # once only
    assert fake.deleted_topics == [t1, t2]


def test_a_clean_close_warns_nothing(admin):
    k = ExternalKafka("b:9092")
    k.create_topic("a")
    g = k.group("g")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.close()
    assert admin().deleted_groups == [g] and admin().removed_configs == [(g, ["share.auto.offset.reset"])]


def test_close_never_raises_over_the_tests_own_outcome(admin):
    k = ExternalKafka("b:9092", OPTIONS)
    k.create_topic("a")

    def refused(topics, **kwargs):
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, f"refused {SECRET}"))

    admin().delete_topics = refused
    with pytest.warns(CleanupWarning, match="cleanup stopped: KafkaException: _INVALID_ARG") as w:
        k.close()
    assert SECRET not in str(w[0].message)


@pytest.mark.parametrize("call,what", [
    (lambda k: k.push_request_errors("ShareFetch", [6]), "error injection"),
    (lambda k: k.push_partition_request_errors("t", 0, "ShareAcknowledge", [121]), "error injection"),
    (lambda k: k.push_broker_request_errors(1, "ShareFetch", [(6, 700)]), "error injection"),
    (lambda k: k.clear_request_errors("Produce"), "error injection"),
    (lambda k: k.broker_down(1), "broker down/up"),
    (lambda k: k.broker_up(1), "broker down/up"),
    (lambda k: k.set_broker_rtt(1, 7000), "broker latency injection"),
    (lambda k: k.move_leader("t", 0, 2), "leader moves"),
    (lambda k: k.track_requests(), "request tracking"),
    (lambda k: k.request_count("ShareFetch"), "request tracking"),
    (lambda k: k.set_max_record_locks(4000), "group.share.partition.max.record.locks is a broker config"),
])
def test_what_only_the_embedded_broker_has_skips_the_test_saying_so(admin, call, what):
    k = ExternalKafka("b:9092")
    with pytest.raises(pytest.skip.Exception, match="needs the embedded broker's") as e:
        call(k)
    assert what in str(e.value) and "not available on an external cluster" in str(e.value)
    assert admin().configs == admin().created == []


def test_share_group_membership_skips_on_an_external_cluster(admin):
    from harness.support import ShareGroups

    with pytest.raises(pytest.skip.Exception, match="share-group membership"):
        ShareGroups(ExternalKafka("b:9092"))


def test_option_values_never_reach_a_repr_or_an_error(admin, monkeypatch):
    k = ExternalKafka("b:9092", OPTIONS)
    assert SECRET not in repr(k) and "alice" not in repr(k) and "4 client options" in repr(k)
    admin().answers[("create", k.name("t"))] = failed(KafkaError._AUTHENTICATION, f"bad password {SECRET} for alice")
    with pytest.raises(ClusterError) as e:
        k.create_topic("t")
    assert SECRET not in str(e.value) and "alice" not in str(e.value) and "_AUTHENTICATION" in str(e.value)

    def refuses(conf):  # librdkafka quotes a bad value in its error
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, f'Invalid value "{conf["sasl.password"]}"'))

    monkeypatch.setattr(clusters, "AdminClient", refuses)
    with pytest.raises(ClusterError, match=OPTIONS_VAR) as e:
        ExternalKafka("b:9092", OPTIONS)
    assert SECRET not in str(e.value)
    choice = choose_broker({BOOTSTRAP_VAR: "b:9092", OPTIONS_VAR: "sasl.username=alice;sasl.password=hunter2-secret"})
    assert "b:9092" in choice.describe() and "2 client option(s)" in choice.describe()
    assert "alice" not in choice.describe() + repr(choice) and "hunter2" not in choice.describe() + repr(choice)


def test_an_admin_call_without_an_answer_fails_within_its_bound(admin, monkeypatch):
    monkeypatch.setattr(clusters, "ADMIN_TIMEOUT_S", 0.2)
    k = ExternalKafka("b:9092")
    admin().answers[("create", k.name("t"))] = Future()  # never answered
    with pytest.raises(ClusterError, match=r"creating topic .*: no answer from b:9092 within 0 s"):
        k.create_topic("t")


def test_an_unreachable_cluster_is_an_error_naming_the_variable(admin, monkeypatch):
    def no_answer(self, topic=None, timeout=-1):
        assert timeout == brokers.REACHABLE_TIMEOUT_S
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))

    monkeypatch.setattr(FakeAdmin, "list_topics", no_answer)
    monkeypatch.setattr(FakeAdmin, "poll", lambda self, timeout: 0, raising=False)
    choice = choose_broker({BOOTSTRAP_VAR: "broker:9", OPTIONS_VAR: "sasl.password=hunter2-secret"})
    with pytest.raises(ClusterUnreachable) as e:
        choice.check_reachable()
    text = str(e.value)
    assert f"{BOOTSTRAP_VAR}=broker:9" in text and "_TRANSPORT" in text and OPTIONS_VAR in text
    assert "hunter2-secret" not in text
    assert admin().conf["sasl.password"] == "hunter2-secret"  # the check uses the client options


def test_the_mode_comes_from_the_environment(admin):
    embedded = choose_broker({})
    assert not embedded.external and "embedded" in embedded.describe() and BOOTSTRAP_VAR in embedded.describe()
    embedded.check_reachable()  # nothing to check
    assert not choose_broker({BOOTSTRAP_VAR: "  "}).external
    external = choose_broker({BOOTSTRAP_VAR: " b1:9092,b2:9092 ", OPTIONS_VAR: "security.protocol=SSL"})
    assert external.external and external.bootstrap_servers == "b1:9092,b2:9092"
    k = external.open()
    assert isinstance(k, ExternalKafka) and k.client() == {"bootstrap.servers": "b1:9092,b2:9092",
                                                            "security.protocol": "SSL"}
    assert issubclass(EmbeddedBroker, EmbeddedKafka) and not EmbeddedBroker.external


def test_options_are_key_value_entries(tmp_path):
    assert parse_options("") == {}
    assert parse_options(" security.protocol = SASL_SSL ;sasl.password=a=b==\nsasl.username=u;") == {
        "security.protocol": "SASL_SSL", "sasl.password": "a=b==", "sasl.username": "u"}
    f = tmp_path / "client.properties"
    f.write_text("# the cluster's credentials\nsasl.password=with;semicolon\n\nsasl.mechanism=PLAIN\n")
    assert parse_options(f"@{f}") == {"sasl.password": "with;semicolon", "sasl.mechanism": "PLAIN"}


@pytest.mark.parametrize("text,needle", [
    ("security.protocol=SSL;hunter2-secret", "entry 2 is not key=value"),
    ("=hunter2-secret", "entry 1 is not key=value"),
    ("kafka.sasl.password=hunter2-secret", "without 'kafka.'"),
    ("bootstrap.servers=hunter2-secret", BOOTSTRAP_VAR),
    ("group.id=hunter2-secret", "names its own groups"),
    ("@/no/such/file-hunter2-secret", "cannot read"),
])
def test_malformed_options_are_named_by_position_never_by_value(text, needle):
    with pytest.raises(ValueError, match=OPTIONS_VAR) as e:
        parse_options(text)
    assert needle in str(e.value)
    if not text.startswith("@"):
        assert "hunter2-secret" not in str(e.value)


def test_a_start_script_makes_the_run_real_and_a_cluster_of_yours_wins_over_it(tmp_path):
    """SPARK_SHARE_TEST_KAFKA_START: the harness starts a real broker (not yet at collection: the run
    is real, its bootstrap unknown); a missing script is an error naming the variable; with
    SPARK_SHARE_TEST_BOOTSTRAP set too, the cluster of yours is used and nothing is started."""
    from harness.kafka_kit import DIST_START, HOME_VAR, START_VAR

    script = tmp_path / "start.sh"
    script.write_text("#!/bin/sh\n")
    kit = choose_broker({START_VAR: str(script)})
    assert kit.external and kit.start_script == str(script) and kit.bootstrap_servers is None
    assert START_VAR in kit.describe() and str(script) in kit.describe()
    with pytest.raises(ValueError, match=START_VAR):
        choose_broker({START_VAR: str(tmp_path / "missing.sh")})
    yours = choose_broker({START_VAR: str(script), BOOTSTRAP_VAR: "b:9092"})
    assert yours.bootstrap_servers == "b:9092" and yours.start_script is None
    assert yours.start() is yours, "a cluster of yours is never started"
    assert HOME_VAR in choose_broker({}).describe(), "the embedded run says how to run on a real broker"
    home = choose_broker({HOME_VAR: str(tmp_path)})
    assert home.external and home.start_script == DIST_START, "KAFKA_HOME: the project's own start script"
    assert choose_broker({HOME_VAR: str(tmp_path), START_VAR: str(script)}).start_script == str(script)
