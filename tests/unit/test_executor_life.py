"""``spark_share.consumers.executor_life`` and the agent's leave once its executor is gone.

Covers: the JVM above a read task is found through pyspark's daemon (a process named ``java`` two levels
up), none when there is none; a call runs once a followed process exits, at once when it is already
gone; an agent whose executor exited leaves only once the tracker has had the broker's answers for every
slot it holds, after its last answer is sent.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from spark_share.acknowledgement import ACCEPT
from spark_share.consumers import executor_life
from spark_share.consumers.agent_acks import AgentAcknowledgements, Cached
from spark_share.transport.protocol import AckResult
from spark_share.verdict_set import VerdictSet

FIND = "from spark_share.consumers.executor_life import executor_pid; print(executor_pid())"


def test_the_jvm_above_a_read_task_is_found_through_the_daemon(tmp_path):
    java = tmp_path / "java"  # the kernel names a process after the file it runs
    java.symlink_to(sys.executable)
    # "java" -> daemon -> worker, as an executor starts pyspark's daemon, which forks the workers.
    py = sys.executable  # by its own name: under "java", sys.executable names the link
    worker = f"import subprocess; subprocess.run([{py!r}, '-c', {FIND!r}], check=True)"
    daemon = f"import subprocess; subprocess.run([{py!r}, '-c', {worker!r}], check=True)"
    jvm = subprocess.Popen([str(java), "-c", f"import os, subprocess; print(os.getpid(), flush=True); "
                            f"subprocess.run([{py!r}, '-c', {daemon!r}], check=True)"],
                           stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    out, _ = jvm.communicate(timeout=60)
    jvm_pid, found = out.split()
    assert found == jvm_pid
    assert subprocess.run([sys.executable, "-c", FIND], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONPATH=os.getcwd())).stdout.strip() == "None"


def test_a_call_runs_once_the_process_exits_and_at_once_when_it_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gone = threading.Event()
    assert executor_life.when_gone(proc.pid, gone.set)
    assert not gone.wait(0.2), "called while the process runs"
    proc.stdin.close()
    proc.wait(30)
    assert gone.wait(10)
    again = threading.Event()
    assert not executor_life.when_gone(proc.pid, again.set)  # reaped: no such process
    assert again.is_set()


class OrphanedAgent(AgentAcknowledgements):
    """The acknowledgement part of an agent, holding one (batch, slot) that acquired nothing."""

    def __init__(self):
        self.agent_id = "w1:1"
        self.tracker_id = "0123456789abcdef"
        self._lock = threading.Lock()
        self._cache = {(4, 0): Cached(4, 0, None, b"", 0, 0)}
        self._budget = None
        self._acks = {}
        self._staged = {}
        self._orphaned = False
        self.left = threading.Event()

    def shutdown(self) -> None:
        self.left.set()


def test_an_agent_whose_executor_is_gone_leaves_after_its_last_answer():
    agent = OrphanedAgent()
    agent.executor_gone()
    assert not agent.left.wait(0.2), "it left holding a slot the tracker has not acknowledged"
    agent._ack(4, VerdictSet(), ACCEPT, 5)
    rep, blob, then = agent._on_ack_result(None, AckResult(4))
    assert rep == {"slots": {}} and blob == b""
    assert not agent.left.is_set(), "it must not leave before its answer is sent"
    then()
    assert agent.left.wait(10)
    idle = OrphanedAgent()
    idle._cache.clear()
    idle.executor_gone()  # holds nothing: it leaves at once
    assert idle.left.wait(10)
