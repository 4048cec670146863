"""The project's start script for an Apache Kafka distribution (tests/harness/kafka_dist/start.sh and
stop.sh, through tests/harness/kafka_kit.py), against a stand-in distribution: ``bin/kafka-storage.sh``
and ``bin/kafka-server-start.sh`` that record what they were asked and listen where a broker would.

What a real Kafka does with the properties is the real pass's to show (KAFKA_HOME set); this proves the
script's side of the contract on every machine: the properties it writes (ours, then EXTRA_PROPS, then
EXTRA_PROPS_FILE, the later line of a key winning), formatting once per data directory with the
FORMAT_ARGS as given, the pid file of the process that listens, restart, kill -9 by pid file, three
nodes of one cluster, and the errors for a missing or too old distribution."""
from __future__ import annotations

import os
import socket
import sys
import textwrap

import pytest

from harness.kafka_kit import DIST_START, TEST_BROKER_PROPS, KitCluster, KitError

FAKE_BROKER = textwrap.dedent('''
    """A stand-in for kafka.Kafka: checks the data directory was formatted, listens on the first
    listener's port, and records its properties and environment beside them."""
    import json, os, signal, socket, sys

    path = sys.argv[1]
    props = {}
    for line in open(path).read().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            props[k] = v  # the later line of a key wins, as java.util.Properties reads it
    meta = os.path.join(props["log.dirs"], "meta.properties")
    if not os.path.exists(meta):
        sys.exit("not formatted: " + meta)
    port = int(props["listeners"].split(",")[0].rsplit(":", 1)[1])
    with open(os.path.join(os.path.dirname(path), "effective.json"), "w") as f:
        json.dump({"props": props, "heap": os.environ.get("KAFKA_HEAP_OPTS"), "log_dir": os.environ.get("LOG_DIR"),
                   "pid": os.getpid()}, f)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(8)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    while True:
        s.accept()[0].close()
''')

STORAGE = textwrap.dedent('''\
    #!/usr/bin/env bash
    set -eu
    case "$1" in
        random-uuid) echo "FakeRandomClusterId00A" ;;
        format)
            shift
            id=""; conf=""
            while [ $# -gt 0 ]; do
                case "$1" in
                    -t) id="$2"; shift 2 ;;
                    -c) conf="$2"; shift 2 ;;
                    *) break ;;
                esac
            done
            dirs="$(grep '^log.dirs=' "$conf" | tail -n 1 | cut -d= -f2-)"
            mkdir -p "$dirs"
            echo "cluster.id=$id" > "$dirs/meta.properties"
            printf '%s\\n' "$@" > "$dirs/../format-args"
            echo x >> "$dirs/../formats"
            ;;
    esac
''')


@pytest.fixture
def kafka_home(tmp_path, monkeypatch):
    """A stand-in distribution of Kafka 4.2.1, as KAFKA_HOME."""
    home = tmp_path / "kafka_2.13-4.2.1"
    (home / "bin").mkdir(parents=True)
    (home / "libs").mkdir()
    (home / "libs" / "kafka-clients-4.2.1.jar").write_bytes(b"")
    (home / "bin" / "fake_broker.py").write_text(FAKE_BROKER)
    (home / "bin" / "kafka-storage.sh").write_text(STORAGE)
    (home / "bin" / "kafka-server-start.sh").write_text(
        f'#!/usr/bin/env bash\nexec "{sys.executable}" "$(dirname "$0")/fake_broker.py" "$@"\n')
    for name in ("kafka-storage.sh", "kafka-server-start.sh"):
        os.chmod(home / "bin" / name, 0o755)
    monkeypatch.setenv("KAFKA_HOME", str(home))
    return home


def _effective(node) -> dict:
    import json

    with open(os.path.join(node.data_dir, "effective.json")) as f:
        return json.load(f)


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 2).close()
        return True
    except OSError:
        return False


def test_a_node_is_formatted_once_listens_restarts_and_is_killed_by_its_pid_file(kafka_home, tmp_path):
    extra = tmp_path / "extra.properties"
    extra.write_text("group.share.record.lock.duration.ms=45000\nnum.partitions=3\n")
    users = "--add-scram SCRAM-SHA-512=[name=admin,password=pw1] --add-scram SCRAM-SHA-512=[name=alice,password=pw2]"
    kit = KitCluster(DIST_START, props={"group.share.max.size": "2", "num.partitions": "2"}, props_file=str(extra),
                     format_args=users, heap="256M")
    node = kit.nodes[0]
    try:
        kit.start()
        seen = _effective(node)
        assert seen["pid"] == node.pid(), "kafka.pid is not the process that listens"
        assert _listens(node.port) and kit.bootstrap_servers == f"127.0.0.1:{node.port}"
        props = seen["props"]
        assert props["process.roles"] == "broker,controller" and props["node.id"] == "1"
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        assert props["controller.quorum.voters"] == f"1@127.0.0.1:{node.controller_port}"
        assert props["share.coordinator.state.topic.replication.factor"] == "1"
        assert all(props[k] == v for k, v in TEST_BROKER_PROPS.items()), "the suite's broker settings"
        assert props["group.share.max.size"] == "2", "EXTRA_PROPS"
        assert props["num.partitions"] == "3", "EXTRA_PROPS_FILE comes last and wins"
        assert seen["heap"] == "-Xms256M -Xmx256M" and seen["log_dir"].startswith(node.data_dir)
        with open(os.path.join(node.data_dir, "format-args")) as f:
            assert f.read().split() == users.split(), "FORMAT_ARGS reach kafka-storage.sh format as given"
        first = node.pid()
        node.restart()
        assert _listens(node.port) and node.pid() != first
        with open(os.path.join(node.data_dir, "formats")) as f:
            assert f.read().count("x") == 1, "a restart formatted the data directory again"
        node.kill()
        assert not node.running() and not _listens(node.port)
        node.start()
        assert _listens(node.port)
    finally:
        kit.close()
    assert not os.path.exists(kit.root) and not _listens(node.port)


def test_three_nodes_form_one_cluster(kafka_home):
    with KitCluster(DIST_START, nodes=3) as kit:
        ids = set()
        for i, node in enumerate(kit.nodes, start=1):
            props = _effective(node)["props"]
            assert props["node.id"] == str(i)
            assert props["controller.quorum.voters"].count("@127.0.0.1:") == 3, "every node knows the three voters"
            assert props["default.replication.factor"] == "3"
            with open(os.path.join(node.data_dir, "logs", "meta.properties")) as f:
                ids.add(f.read().strip())
            assert _listens(node.port)
        assert len(ids) == 1, f"the nodes were formatted with different cluster ids: {ids}"


def test_a_kafka_older_than_4_2_or_none_is_refused_saying_why(kafka_home, monkeypatch):
    os.rename(kafka_home / "libs" / "kafka-clients-4.2.1.jar", kafka_home / "libs" / "kafka-clients-4.1.1.jar")
    kit = KitCluster(DIST_START)
    with pytest.raises(KitError, match=r"is Kafka 4\.1\.1; spark-share needs Kafka >= 4\.2"):
        kit.start()
    monkeypatch.delenv("KAFKA_HOME")
    kit = KitCluster(DIST_START)
    with pytest.raises(KitError, match="set KAFKA_HOME to an unpacked Apache Kafka >= 4.2"):
        kit.start()
