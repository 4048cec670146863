"""``spark_share.executor.launcher``: finding this host's agent, or starting one, from a read task.

No real agent runs: ``subprocess.Popen`` is replaced by a fake agent process (it keeps the ``.alive``
lock it is handed, as a real agent does, opens its socket and says READY on a real pipe) and
``endpoints.connect`` by a fake that connects when that abstract socket name listens; the runtime
directory is a ``tmp_path`` (SPARK_SHARE_RUNTIME_DIR). Covers: an agent that runs is used, none is
spawned; none running, exactly one is spawned and connected to; the Kafka client configs (credentials
included) and the per-query secret travel on the agent's stdin, never in argv nor its environment; one
spawner at a time (the ``.spawn`` lock); the ``.alive`` lock tells a live agent (wait for its socket,
spawn nothing) from a dead one's leftovers (a new agent spawned); an agent that fails or does not start
in time is an error pointing at its log; in a Spark executor, the agent's files are in its first local
dir and each executor has its own agent.
"""
from __future__ import annotations

import fcntl
import json
import os
import stat
import sys
import threading

import pytest

from spark_share import runtime
from spark_share.errors import AgentError
from spark_share.executor import launcher
from spark_share.options import parse_options

TRACKER = ("10.0.0.5", 40100)
TRACKER_ID = "0123456789abcdef"
QUERY_SECRET = "per-query-secret-0123456789"
PASSWORD = "pw-hunter2-xyz"


def options(**extra: str):
    return parse_options({"kafka.bootstrap.servers": "broker:9092", "kafka.group.id": "g", "subscribe": "t",
                          "kafka.security.protocol": "SASL_SSL", "kafka.sasl.mechanism": "PLAIN",
                          "kafka.sasl.username": "alice", "kafka.sasl.password": PASSWORD, **extra})


class Stdin:
    """The agent's stdin pipe: what the spawner wrote, kept after close()."""

    def __init__(self):
        self.data = b""
        self.closed = False

    def write(self, b: bytes) -> int:
        assert not self.closed
        self.data += b
        return len(b)

    def close(self) -> None:
        self.closed = True


class FakeAgentProcess:
    """What ``subprocess.Popen`` returns for ``python -m spark_share.consumers.agent``: the agent holds
    the ``.alive`` lock it inherits (a dup of the spawner's descriptor shares its lock), opens its
    socket and prints READY (or ``reply``) on stdout, a real pipe the launcher select()s on."""

    def __init__(self, host: Host, args, **kw):
        self.args, self.kw = args, kw
        host.spawned.append(self)
        assert runtime.agent_address(TRACKER_ID) not in host.listening, "spawned while an agent listens"
        (alive_fd,) = kw["pass_fds"]
        if host.reply is None or host.reply.startswith(b"READY"):  # one that failed has exited: lock dropped
            host.agent_fds.append(os.dup(alive_fd))  # the "agent" process keeps the locked description
        self.stdin = Stdin()
        r, w = os.pipe()
        if host.reply is not None:
            os.write(w, host.reply)
            if host.open_socket:
                host.listen()
            os.close(w)
        else:
            host.silent_pipes.append(w)  # never says anything
        self.stdout = os.fdopen(r, "rb")

    def wait(self, timeout=None):
        return 0

    def stdin_json(self) -> dict:
        return json.loads(self.stdin.data)


class Host:
    """This host as the launcher sees it: the runtime directory, the agents spawned, connections made."""

    def __init__(self, tmp_path, monkeypatch):
        self.dir = tmp_path / "rt"
        monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(self.dir))
        self.spawned: list[FakeAgentProcess] = []
        self.agent_fds: list[int] = []
        self.silent_pipes: list[int] = []
        self.connects: list[tuple] = []
        self.reply: bytes | None = b"READY 4242\n"
        self.open_socket = True
        self.listening: set[str] = set()  # abstract socket names an agent listens on
        monkeypatch.setattr(launcher.subprocess, "Popen", lambda args, **kw: FakeAgentProcess(self, args, **kw))
        monkeypatch.setattr(launcher.endpoints, "connect", self.connect)

    def connect(self, address, secret, timeout=None, name=None):
        self.connects.append((address, secret, name))
        if address not in self.listening:
            raise ConnectionRefusedError(address)
        return ("conn", address)

    def listen(self) -> None:
        """The agent opens its socket."""
        self.listening.add(runtime.agent_address(TRACKER_ID))

    def base(self) -> str:
        return runtime.agent_base(TRACKER_ID)

    def kill_agent(self) -> None:
        """The agent dies: the kernel drops its locks and its abstract socket; its files stay behind."""
        for fd in self.agent_fds:
            os.close(fd)
        self.agent_fds.clear()
        self.listening.clear()

    def close(self):
        for fd in self.agent_fds + self.silent_pipes:
            os.close(fd)


@pytest.fixture
def host(tmp_path, monkeypatch):
    h = Host(tmp_path, monkeypatch)
    yield h
    h.close()


def ensure(opts=None, timeout=1.0):
    return launcher.ensure_agent(TRACKER, TRACKER_ID, QUERY_SECRET, opts or options(), timeout=timeout)


def locked(path: str) -> bool:
    """Does someone hold ``path``'s flock? (Our own open file description, so it conflicts with theirs.)"""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def hold(path: str) -> int:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_an_agent_that_runs_is_used_and_none_is_spawned(host):
    host.listen()
    assert ensure() == ("conn", runtime.agent_address(TRACKER_ID))
    assert host.spawned == [] and host.connects == [(runtime.agent_address(TRACKER_ID), QUERY_SECRET, "task")]
    assert not os.path.exists(host.base() + ".spawn"), "finding an agent takes no lock"


def test_with_no_agent_one_is_spawned_and_connected_to(host):
    assert ensure() == ("conn", runtime.agent_address(TRACKER_ID))
    (proc,) = host.spawned
    assert proc.args == [sys.executable, "-m", "spark_share.consumers.agent"]
    assert proc.kw["start_new_session"] is True and proc.kw["close_fds"] is True  # detached from the worker
    assert proc.kw["cwd"] == str(host.dir)
    assert proc.stdin.closed
    # The agent holds .alive from now on (the spawner's own descriptor is closed), .spawn is free again.
    assert locked(host.base() + ".alive") and not locked(host.base() + ".spawn")
    log = runtime.agent_log_path(TRACKER_ID)
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600 and proc.kw["stderr"].name == log
    # Spawned agents again find this one.
    assert ensure() and len(host.spawned) == 1


def test_configs_and_secrets_go_on_the_pipe_never_in_argv_or_the_environment(host):
    opts = options(deadLetterTopic="dlq")
    ensure(opts)
    (proc,) = host.spawned
    sent = proc.stdin_json()
    assert sent["tracker"] == list(TRACKER) and sent["tracker_id"] == TRACKER_ID and sent["secret"] == QUERY_SECRET
    assert sent["consumer_config"] == opts.consumer_config() and sent["consumer_config"]["sasl.password"] == PASSWORD
    assert sent["producer_config"] == opts.producer_config()  # a dead-letter topic: the agent produces
    assert sent["secret_values"] == [PASSWORD]
    visible = " ".join(proc.args) + " " + " ".join(f"{k}={v}" for k, v in proc.kw["env"].items())
    for secret in (PASSWORD, QUERY_SECRET, "alice"):
        assert secret not in visible


def test_the_agent_imports_the_spark_share_the_worker_runs(host):
    ensure()
    first = host.spawned[0].kw["env"]["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.isdir(os.path.join(first, "spark_share")), f"{first} is not the parent of the spark_share package"


def test_no_producer_config_without_a_dead_letter_topic(host):
    ensure(options(deadLetterPath="/tmp/dlq"))
    assert host.spawned[0].stdin_json()["producer_config"] == {}


def test_a_live_agents_alive_lock_means_wait_for_its_socket_and_spawn_nothing(host, monkeypatch):
    runtime.runtime_dir()
    alive = hold(host.base() + ".alive")  # an agent that is still starting: no socket yet
    try:
        attempts = []

        def connect(address, secret, timeout=None, name=None):
            attempts.append(address)
            if len(attempts) == 3:  # the agent opens its socket
                host.listen()
            return host.connect(address, secret, timeout, name)
        monkeypatch.setattr(launcher.endpoints, "connect", connect)
        assert ensure() == ("conn", runtime.agent_address(TRACKER_ID))
        assert host.spawned == [] and len(attempts) == 3
    finally:
        os.close(alive)


def test_a_dead_agents_leftovers_are_cleared_and_a_new_agent_spawned(host):
    ensure()
    host.kill_agent()
    assert not locked(host.base() + ".alive")
    assert ensure() == ("conn", runtime.agent_address(TRACKER_ID))
    assert len(host.spawned) == 2


def test_one_spawner_at_a_time(host):
    runtime.runtime_dir()
    spawn = hold(host.base() + ".spawn")  # another read task is deciding to start the agent
    got = []
    t = threading.Thread(target=lambda: got.append(ensure()), daemon=True)
    try:
        t.start()
        t.join(0.3)
        assert t.is_alive() and host.spawned == [], "a second spawner went ahead"
        # The other read task started the agent (it holds .alive, its socket is open) and lets go.
        host.agent_fds.append(hold(host.base() + ".alive"))
        host.listen()
    finally:
        os.close(spawn)
    t.join(10)
    assert not t.is_alive() and got == [("conn", runtime.agent_address(TRACKER_ID))]
    assert host.spawned == [], "the agent the first spawner started must be used, not a second one"


def test_read_tasks_arriving_together_start_one_agent(host):
    got = []
    threads = [threading.Thread(target=lambda: got.append(ensure()), daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 4 and len(host.spawned) == 1


def test_an_agent_that_fails_to_start_is_an_error_pointing_at_its_log(host):
    host.reply, host.open_socket = b"ERROR could not create a share consumer\n", False
    with pytest.raises(AgentError, match=r"the spark-share agent failed to start: ERROR could not create a share "
                                           r"consumer; see .*agent-0123456789abcdef\.log"):
        ensure()
    assert not locked(host.base() + ".spawn") and not locked(host.base() + ".alive")
    host.reply = b""  # it said nothing at all: ended from outside, as a sandbox ends what a task starts
    with pytest.raises(AgentError, match=r"ended before it started \(see .*agent-0123456789abcdef\.log\): this "
                                         r"executor does not let a task start a process .* readMode=driver"):
        ensure()


def test_an_agent_that_never_says_ready_times_out(host, monkeypatch):
    monkeypatch.setattr(launcher, "SPAWN_TIMEOUT_S", 0.2)
    host.reply = None
    with pytest.raises(AgentError, match=r"did not start within 0 s; see .*\.log"):
        ensure()
    assert not locked(host.base() + ".spawn")


def test_waiting_for_a_live_agents_socket_is_bounded(host, monkeypatch):
    monkeypatch.setattr(launcher, "SPAWN_TIMEOUT_S", 0.2)
    runtime.runtime_dir()
    alive = hold(host.base() + ".alive")  # it never opens its socket
    try:
        with pytest.raises(AgentError, match=r"did not open its socket within 0 s; see .*agent-0123456789abcdef\.log"):
            ensure()
    finally:
        os.close(alive)
    assert host.spawned == []


def test_a_read_task_waiting_on_an_agent_that_stops_starts_the_next_one(host, monkeypatch):
    """The run's agent stops while a read task waits for its socket (cut from its tracker, it leaves the host
    before its consumers finish closing, which can take as long as the network is cut): the read task
    starts the next agent as soon as the lock is let go, instead of waiting for a socket that never comes."""
    runtime.runtime_dir()
    alive = hold(host.base() + ".alive")  # the agent, stopping: its socket already closed
    attempts = []

    def connect(address, secret, timeout=None, name=None):
        attempts.append(address)
        if len(attempts) == 3:  # it lets go of the host
            os.close(alive)
        return host.connect(address, secret, timeout, name)
    monkeypatch.setattr(launcher.endpoints, "connect", connect)
    assert ensure() == ("conn", runtime.agent_address(TRACKER_ID))
    assert len(host.spawned) == 1 and len(attempts) == 4


def test_in_an_executor_the_agent_lives_in_its_local_dir_and_each_executor_has_its_own(host, tmp_path, monkeypatch):
    """A Python worker of a Spark executor has the executor's local dirs in SPARK_LOCAL_DIRS (per application,
    removed by Spark): the agent's files go to the first, nothing to a runtime directory, and its socket is
    an abstract name (no file; a local dir's path is too long for one) that differs per executor. A
    SPARK_SHARE_RUNTIME_DIR the user set wins."""
    first, second = tmp_path / "executor-1" / ("blockmgr-" + "0" * 36), tmp_path / "executor-2" / "blockmgr-b"
    first.mkdir(parents=True)
    second.mkdir(parents=True)
    monkeypatch.delenv("SPARK_SHARE_RUNTIME_DIR")
    monkeypatch.setenv("SPARK_LOCAL_DIRS", f"{first},{tmp_path / 'another-disk'}")
    one = runtime.agent_address(TRACKER_ID)
    assert ensure() == ("conn", one)
    (proc,) = host.spawned
    assert proc.kw["cwd"] == str(first) and proc.kw["stderr"].name == str(first / "agent-0123456789abcdef.log")
    assert locked(str(first / "agent-0123456789abcdef.alive"))
    assert not os.path.exists(f"/tmp/spark-share-{os.getuid()}/agent-0123456789abcdef.log")
    assert one.startswith("\0" + runtime.ABSTRACT_PREFIX + TRACKER_ID) and len(one.encode()) < 108
    assert len(str(first / "agent-0123456789abcdef.sock")) > 108, "a socket file there would not fit"
    monkeypatch.setenv("SPARK_LOCAL_DIRS", str(second))  # another executor of the host
    assert runtime.agent_address(TRACKER_ID) != one
    assert ensure() == ("conn", runtime.agent_address(TRACKER_ID)) and len(host.spawned) == 2
    assert proc.kw["cwd"] == str(first) and host.spawned[1].kw["cwd"] == str(second)
    monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(host.dir))
    assert runtime.agent_dir() == str(host.dir), "the directory the user set wins"
