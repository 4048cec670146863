"""Real Kafka brokers that the test harness starts and stops itself, from a start script: the project's own
(``tests/harness/kafka_dist/start.sh``, which runs an Apache Kafka >= 4.2 distribution unpacked at
``KAFKA_HOME``), or one the user names (``SPARK_SHARE_TEST_KAFKA_START``).

Owns: choosing free loopback ports and a data directory, the broker properties the suite needs (the
bounds its share-group settings ask for), starting, stopping (``stop.sh`` beside the start script, or
``SPARK_SHARE_TEST_KAFKA_STOP``), killing (SIGKILL by the broker's pid file) and restarting a broker
on the same data directory (a broker restart keeps topics, records and share-group state), three
nodes as one replicated cluster, and removing the data directories it made.

A start script takes the environment ``DATA_DIR``, ``PORT``, ``CONTROLLER_PORT``, ``NODE_ID``,
``CLUSTER_ID``, ``HEAP``, ``EXTRA_PROPS`` (``k=v`` lines), ``EXTRA_PROPS_FILE``, ``FORMAT_ARGS``
(``kafka_dist/start.sh`` documents each); it prints the bootstrap address as its last line and writes
the broker's pid to ``DATA_DIR/kafka.pid``.

Must never: stop or kill a process it did not start (only by the pid file of a data directory it
made), leave a broker running after ``close()``, or wait without a bound.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping

START_VAR = "SPARK_SHARE_TEST_KAFKA_START"
STOP_VAR = "SPARK_SHARE_TEST_KAFKA_STOP"
HOME_VAR = "KAFKA_HOME"
# The project's start script for an Apache Kafka distribution unpacked at $KAFKA_HOME.
DIST_START = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kafka_dist", "start.sh")


def start_script(env: Mapping[str, str] = os.environ) -> str | None:
    """The start script a real pass uses: ``SPARK_SHARE_TEST_KAFKA_START``, else the project's own when
    ``KAFKA_HOME`` is set, else None (no real Kafka given)."""
    named = env.get(START_VAR, "").strip()
    if named:
        return named
    return DIST_START if env.get(HOME_VAR, "").strip() else None
START_TIMEOUT_S = 120.0  # the script's own port wait is 90 s; a start after kill -9 takes ~12 s more
STOP_TIMEOUT_S = 60.0

# What the suite asks of a test broker: the bounds its groups' settings need (Kafka 4.2 refuses a
# group config outside group.share.min/max.*). The heartbeat stays at Kafka's default (5 s), as on
# users' clusters; a group may ask for 1 s.
TEST_BROKER_PROPS = {
    "group.share.min.record.lock.duration.ms": "1000",
    "group.share.min.session.timeout.ms": "6000",
    "group.share.min.heartbeat.interval.ms": "1000",
}


def free_ports(n: int) -> list[int]:
    """``n`` loopback ports nothing listens on now (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class KitError(RuntimeError):
    """A broker of the kit did not start or stop."""


class KitBroker:
    """One broker node started from the start script, on its own data directory and ports."""

    def __init__(self, script: str, data_dir: str, port: int, controller_port: int, *, node_id: int = 1,
                 cluster_id: str | None = None, heap: str = "768M", props: Mapping[str, str] | None = None,
                 props_file: str | None = None, format_args: str = ""):
        self.script = script
        self.stop_script = os.environ.get(STOP_VAR, "").strip() or os.path.join(os.path.dirname(script), "stop.sh")
        self.data_dir = data_dir
        self.port = port
        self.controller_port = controller_port
        self.bootstrap = f"127.0.0.1:{port}"
        self._env = {"DATA_DIR": data_dir, "PORT": str(port), "CONTROLLER_PORT": str(controller_port),
                     "NODE_ID": str(node_id), "HEAP": heap,
                     "EXTRA_PROPS": "\n".join(f"{k}={v}" for k, v in {**TEST_BROKER_PROPS, **(props or {})}.items())}
        if cluster_id:
            self._env["CLUSTER_ID"] = cluster_id
        if props_file:
            self._env["EXTRA_PROPS_FILE"] = props_file
        self._format_args = format_args  # first start only (an empty data directory)
        self.starts = 0

    def start(self, wait: bool = True) -> subprocess.Popen | str:
        """Start the node (formatting its data directory the first time); the bootstrap address.
        ``wait=False``: the script's process, for nodes that must start together (a quorum)."""
        env = {**os.environ, **self._env}
        if not self.starts and self._format_args:
            env["FORMAT_ARGS"] = self._format_args
        self.starts += 1
        proc = subprocess.Popen(["bash", self.script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        return self.finish_start(proc) if wait else proc

    def finish_start(self, proc: subprocess.Popen) -> str:
        try:
            out, err = proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise KitError(f"{self.script} did not finish within {START_TIMEOUT_S:.0f} s: {err[-2000:]}") from None
        if proc.returncode != 0:
            raise KitError(f"{self.script} failed ({proc.returncode}) for {self.data_dir}: {err[-2000:]}")
        lines = out.strip().splitlines()
        return lines[-1].strip() if lines else self.bootstrap

    def pid(self) -> int | None:
        try:
            return int(open(os.path.join(self.data_dir, "kafka.pid")).read().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self) -> None:
        """A clean stop (SIGTERM, the script's own SIGKILL after 30 s)."""
        if not self.running():
            return
        out = subprocess.run(["bash", self.stop_script], env={**os.environ, **self._env}, capture_output=True,
                             text=True, timeout=STOP_TIMEOUT_S)
        if out.returncode != 0 or self.running():
            raise KitError(f"{self.stop_script} did not stop the broker of {self.data_dir}: {out.stderr[-2000:]}")

    def kill(self) -> None:
        """``kill -9`` of the broker (a crash): its members' sessions stay on the broker until they expire."""
        pid = self.pid()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 30
        while self.running():
            if time.monotonic() > deadline:
                raise KitError(f"broker pid {pid} still runs 30 s after SIGKILL")
            time.sleep(0.05)  # polling interval of a bounded wait for the kernel to reap it

    def restart(self) -> str:
        self.stop()
        return self.start()


class KitCluster:
    """One broker (``nodes=1``) or a replicated cluster of three KRaft nodes on loopback, in data
    directories of its own, removed by ``close()``."""

    def __init__(self, script: str, nodes: int = 1, props: Mapping[str, str] | None = None,
                 props_file: str | None = None, format_args: str = "", heap: str | None = None,
                 ports: tuple[int, int] | None = None):
        """``ports``: (client, controller) of a single node whose listeners ``props_file`` names."""
        self.root = tempfile.mkdtemp(prefix="spark-share-kafka-")
        ports = list(ports) if ports else free_ports(2 * nodes)
        extra = dict(props or {})
        cluster_id = None
        if nodes > 1:
            voters = ",".join(f"{i + 1}@127.0.0.1:{ports[2 * i + 1]}" for i in range(nodes))
            replicas = str(min(3, nodes))
            extra = {"controller.quorum.voters": voters, "offsets.topic.replication.factor": replicas,
                     "transaction.state.log.replication.factor": replicas, "transaction.state.log.min.isr": "2",
                     "share.coordinator.state.topic.replication.factor": replicas,
                     "share.coordinator.state.topic.min.isr": "2", "default.replication.factor": replicas,
                     "min.insync.replicas": "2", **extra}
            cluster_id = _random_cluster_id()
        self.nodes = [KitBroker(script, os.path.join(self.root, f"n{i + 1}"), ports[2 * i], ports[2 * i + 1],
                                node_id=i + 1, cluster_id=cluster_id, props=extra, props_file=props_file,
                                format_args=format_args, heap=heap or ("768M" if nodes == 1 else "512M"))
                      for i in range(nodes)]
        self.bootstrap_servers = ",".join(n.bootstrap for n in self.nodes)

    def start(self) -> KitCluster:
        try:
            if len(self.nodes) == 1:
                self.nodes[0].start()
            else:  # a node opens its port only once a quorum exists: start them together
                procs = [n.start(wait=False) for n in self.nodes]
                for n, p in zip(self.nodes, procs):
                    n.finish_start(p)
        except BaseException:
            self.close()
            raise
        return self

    def node(self, node_id: int) -> KitBroker:
        return self.nodes[node_id - 1]

    def close(self) -> None:
        """Stops every node and removes the data. A cluster's nodes are killed: its data goes next, and
        the last node of a clean stop, alone without a quorum, waits out the stop script's 30 s."""
        if len(self.nodes) > 1:
            for n in self.nodes:
                n.kill()
        else:
            try:
                self.nodes[0].stop()
            except (KitError, subprocess.TimeoutExpired):
                self.nodes[0].kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> KitCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _random_cluster_id() -> str:
    """A KRaft cluster id (22 url-safe base64 characters of a random UUID), as StorageTool makes them."""
    import base64
    import uuid

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
