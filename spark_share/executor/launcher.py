"""Finding or starting this executor's agent, from a read task (a Python worker), or in local mode from
the source runner as the query starts.

Owns: connecting a read task to the agent of its query run in this executor, and starting that agent
when none runs: one spawner at a time (``.spawn`` lock), an agent's life marked by a lock it holds
(``.alive``), its parameters and Kafka client configs handed over on a pipe. Its files are in the
executor's Spark local dir (``runtime.agent_dir``), its socket is abstract.

Must never: hold a consumer or any state beyond the call (Python workers come and go), pass a
credential on a command line or a socket, or wait without a bound.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import subprocess
import sys
import time

from .. import runtime
from ..consumers import executor_life
from ..errors import AgentError
from ..transport import endpoints, wire

SPAWN_TIMEOUT_S = 60.0


def ensure_agent(tracker_addr: tuple[str, int], tracker_id: str, secret: str, opts,
                 timeout: float = 10.0) -> wire.RpcConnection:
    """Connect to this executor's agent for the tracker, starting it if it is not running.

    The Kafka client configs (credentials included) reach a new agent from ``opts``, the options
    Spark shipped with the read task, through a pipe: they never cross a socket of ours.

    Two locks make this safe when Spark kills a worker half way: ``.spawn`` lets one read task at a
    time decide to start an agent; ``.alive`` is taken by the spawner and handed to the agent (an
    inherited file description), so it is held as long as an agent serves, starting or not. An agent
    that stops lets it go as it closes its socket (``Agent._leave_host``): a read task that finds
    neither a socket nor a held lock starts the next one."""
    address = runtime.agent_address(tracker_id)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while True:
        try:
            return endpoints.connect(address, secret, timeout=timeout, name="task")
        except ConnectionRefusedError:  # no agent listens (an abstract socket goes with its process)
            pass
        if _spawn_unless_alive(tracker_addr, tracker_id, secret, opts):
            return endpoints.connect(address, secret, timeout=timeout, name="task")
        if time.monotonic() > deadline:
            raise AgentError(f"the spark-share agent did not open its socket within {SPAWN_TIMEOUT_S:.0f} s; "
                             f"see {runtime.agent_log_path(tracker_id)}")
        time.sleep(0.05)  # an agent is starting (its socket is not open yet): a bounded poll


def _spawn_unless_alive(tracker_addr, tracker_id: str, secret: str, opts) -> bool:
    """Start the agent unless one holds the life lock (it is starting, or serving): True if started."""
    base = runtime.agent_base(tracker_id)
    spawn_fd = os.open(base + ".spawn", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(spawn_fd, fcntl.LOCK_EX)  # released if this worker dies; held only to check or to spawn
        alive_fd = os.open(base + ".alive", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(alive_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(alive_fd)
            return False
        try:
            _spawn_agent(tracker_addr, tracker_id, secret, opts, alive_fd)
        finally:
            os.close(alive_fd)  # the agent keeps its own copy of the locked description
        return True
    finally:
        os.close(spawn_fd)


def _spawn_agent(tracker_addr, tracker_id: str, secret: str, opts, alive_fd: int) -> None:
    log_path = runtime.agent_log_path(tracker_id)
    env = dict(os.environ)
    # The worker may import this package from a path Spark added (--py-files, a zip); so must the agent.
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above spark_share/
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in sys.path if p and os.path.exists(p)])
    with open(log_path, "ab") as logf:
        os.chmod(log_path, 0o600)
        proc = subprocess.Popen(
            [sys.executable, "-m", "spark_share.consumers.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
            close_fds=True, pass_fds=(alive_fd,), start_new_session=True, cwd=runtime.agent_dir(), env=env)
    assert proc.stdin is not None and proc.stdout is not None  # both are pipes
    # Parameters travel on stdin, never on the command line (visible to every user in ps).
    proc.stdin.write(json.dumps({"tracker": list(tracker_addr), "tracker_id": tracker_id, "secret": secret,
                                 "alive_fd": alive_fd, "executor_pid": executor_life.executor_pid(),
                                 "consumer_config": opts.consumer_config(),
                                 "producer_config": opts.producer_config() if opts.dead_letter_topic else {},
                                 "secret_values": opts.secret_values()}).encode() + b"\n")
    proc.stdin.close()
    proc.wait(SPAWN_TIMEOUT_S)  # the intermediate process exits once the agent has forked away
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    line = b""
    fd = proc.stdout.fileno()
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AgentError(f"the spark-share agent did not start within {SPAWN_TIMEOUT_S:.0f} s; see {log_path}")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        line += chunk
    proc.stdout.close()
    if not line.startswith(b"READY"):
        said = line.decode(errors="replace").strip()
        if not said:  # it said nothing at all: ended from outside, as a sandbox ends what a task starts
            raise AgentError(f"the spark-share agent was ended before it started (see {log_path}): this executor "
                             "does not let a task start a process that outlives it (serverless, standard access "
                             "mode and Kubernetes sandboxes do not); use the source option readMode=driver there")
        raise AgentError(f"the spark-share agent failed to start: {said}; see {log_path}")
