"""The embedded broker (librdkafka's mock cluster) against confluent-kafka clients."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from confluent_kafka import AcknowledgeType, Producer, ShareConsumer

from spark_share import embedded
from spark_share.embedded import EmbeddedKafka, EmbeddedKafkaError, parse_topic_spec
from support import wait_until

ERR_INVALID_RECORD_STATE = 121


def share_consumer(kafka, group="g"):
    c = ShareConsumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
                       "share.acknowledgement.mode": "explicit"})
    c.subscribe(["t"])
    return c


def produce(kafka, n, partitions=1, topic="t"):
    p = Producer({"bootstrap.servers": kafka.bootstrap_servers, "linger.ms": 2})
    for i in range(n):
        p.produce(topic, key=str(i).encode(), value=str(i).encode(), partition=i % partitions)
    assert p.flush(10) == 0
    return p  # keep it alive: a disconnecting client ends share sessions on the mock


def poll_until(c, n, timeout=10.0):
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [m for m in c.poll(0.2) if m.error() is None]
    return got


def test_accept_release_reject(kafka):
    kafka.create_topic("t", 1)
    p = produce(kafka, 30)
    c = share_consumer(kafka)
    try:
        msgs = poll_until(c, 30)
        assert sorted(m.offset() for m in msgs) == list(range(30))
        assert {m.delivery_count() for m in msgs} == {1}
        for m in msgs:
            kind = {0: AcknowledgeType.ACCEPT, 1: AcknowledgeType.RELEASE, 2: AcknowledgeType.REJECT}[m.offset() % 3]
            c.acknowledge(m, kind)
        assert all(e is None for e in c.commit_sync(10).values())
        again = poll_until(c, 10)
        # RELEASEd records come back with a higher delivery count; REJECTed and ACCEPTed ones never.
        assert sorted(m.offset() for m in again) == [o for o in range(30) if o % 3 == 1]
        assert {m.delivery_count() for m in again} == {2}
        for m in again:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        c.commit_sync(10)
        assert poll_until(c, 1, timeout=2) == []
    finally:
        c.close()
    del p


def test_lock_expiry_redelivers(kafka):
    kafka.set_record_lock_duration(1000)
    kafka.create_topic("t", 1)
    p = produce(kafka, 5)
    c = share_consumer(kafka)
    try:
        msgs = poll_until(c, 5)
        assert len(msgs) == 5
        time.sleep(2.0)  # the condition under test: the lock's time passes without an acknowledgement
        for m in msgs:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        result = c.commit_sync(10)
        codes = {e.args[0].code() for e in result.values() if e is not None}
        assert codes == {ERR_INVALID_RECORD_STATE}, result
        again = poll_until(c, 5)
        assert sorted(m.offset() for m in again) == list(range(5))
        assert {m.delivery_count() for m in again} == {2}
        for m in again:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        assert all(e is None for e in c.commit_sync(10).values())
    finally:
        c.close()
    del p


CONSUMER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from confluent_kafka import ShareConsumer, AcknowledgeType
    c = ShareConsumer({"bootstrap.servers": sys.argv[1], "group.id": "split", "share.acknowledgement.mode": "explicit"})
    c.subscribe(["t"])
    c.poll(0.5)
    print("ready", flush=True)
    got, idle_since = [], None
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        msgs = [m for m in c.poll(0.2) if m.error() is None]
        for m in msgs:
            got.append([m.partition(), m.offset()])
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        if msgs:
            c.commit_sync(10)
            idle_since = None
        elif got:
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since > 3:
                break
    print(json.dumps(got), flush=True)
    c.close()
""")


def test_two_consumer_processes_split_a_topic(kafka):
    kafka.create_topic("t", 4)
    procs = [subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, kafka.bootstrap_servers],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for pr in procs:
            assert pr.stdout.readline().strip() == "ready"
        p = produce(kafka, 2000, partitions=4)
        outs = [json.loads(pr.communicate(timeout=60)[0].strip().splitlines()[-1]) for pr in procs]
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
    seen = [tuple(x) for out in outs for x in out]
    assert len(seen) == len(set(seen)) == 2000, f"{len(seen)} seen, {len(set(seen))} distinct"
    assert all(outs), "one consumer got nothing: the topic was not split"
    del p


def test_injected_errors_change_what_clients_see(kafka):
    kafka.create_topic("t", 1)
    p = produce(kafka, 10)
    c = share_consumer(kafka)
    try:
        kafka.push_request_errors("ShareFetch", [6, 6])  # NOT_LEADER_OR_FOLLOWER: retried by the client
        msgs = poll_until(c, 10, timeout=20)
        assert len(msgs) == 10
        for m in msgs:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        kafka.push_request_errors("ShareAcknowledge", [ERR_INVALID_RECORD_STATE])
        result = c.commit_sync(10)
        errors = [e for e in result.values() if e is not None]
        assert errors and errors[0].args[0].code() == ERR_INVALID_RECORD_STATE
        # The acknowledgement failed, so the records come back.
        again = poll_until(c, 10, timeout=20)
        assert sorted(m.offset() for m in again) == list(range(10))
        for m in again:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        assert all(e is None for e in c.commit_sync(10).values())
    finally:
        c.close()
    del p


def test_broker_down_and_up(kafka):
    kafka.create_topic("t", 1)
    p = produce(kafka, 5)
    c = share_consumer(kafka)
    try:
        kafka.broker_down(1)
        assert poll_until(c, 1, timeout=2) == []
        kafka.broker_up(1)
        msgs = poll_until(c, 5, timeout=30)
        assert sorted(m.offset() for m in msgs) == list(range(5))
    finally:
        c.close()
    del p


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_shutdown_leaves_no_thread_behind():
    with EmbeddedKafka() as k:  # warm up: library load, first-time allocations
        k.create_topic("t", 1)
    before = _os_threads()
    for _ in range(5):
        k = EmbeddedKafka(brokers=2)
        k.create_topic("t", 2)
        assert _os_threads() > before
        k.close()
        k.close()  # idempotent
    wait_until(lambda: _os_threads() <= before, timeout=10, message="threads left behind")
    assert not k.running
    with pytest.raises(EmbeddedKafkaError, match="closed"):
        k.create_topic("x", 1)


def test_closed_on_exception():
    with pytest.raises(RuntimeError):
        with EmbeddedKafka() as k:
            raise RuntimeError("boom")
    assert not k.running


def test_missing_symbol_names_the_needed_version(monkeypatch):
    monkeypatch.setattr(embedded, "_lib", None)
    monkeypatch.setitem(embedded._SIGNATURES, "rd_kafka_mock_sharegroup_from_the_future", ([], None))
    with pytest.raises(EmbeddedKafkaError, match=r"confluent-kafka>=2\.16\.1"):
        EmbeddedKafka()


def test_parse_topic_spec():
    assert parse_topic_spec("orders:4") == ("orders", 4)
    assert parse_topic_spec("orders") == ("orders", 1)
    for bad in ("", ":3", "a:x", "a:0"):
        with pytest.raises(ValueError):
            parse_topic_spec(bad)


def test_broker_command_runs_until_interrupted():
    proc = subprocess.Popen([sys.executable, "-m", "spark_share.cli", "broker", "--topic", "t:2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("bootstrap.servers=127.0.0.1:")
        bootstrap = line.split("=", 1)[1]
        p = Producer({"bootstrap.servers": bootstrap})
        p.produce("t", value=b"hello", partition=1)
        assert p.flush(10) == 0
        c = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": "cli", "share.acknowledgement.mode": "explicit"})
        c.subscribe(["t"])
        msgs = poll_until(c, 1)
        assert [m.value() for m in msgs] == [b"hello"]
        c.acknowledge(msgs[0], AcknowledgeType.ACCEPT)
        c.commit_sync(10)
        c.close()
        del p
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("args", [["--help"], ["broker", "--help"], ["produce", "--help"], ["demo", "--help"]])
def test_cli_help(args):
    out = subprocess.run([sys.executable, "-m", "spark_share.cli", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout


def test_spark_session_fixture(spark):
    from chispa import assert_df_equality

    assert spark.range(10).count() == 10
    df = spark.createDataFrame([(1, "a"), (2, "b")], "id long, v string")
    assert_df_equality(df.orderBy("id"), spark.createDataFrame([(1, "a"), (2, "b")], "id long, v string"))
