"""An agent's life bound to its executor's: which JVM started the read task that starts an agent, and a
call when that JVM has exited.

Dynamic allocation removes idle executors and Kubernetes ends an executor's pod; an agent detached from
its Python worker would otherwise serve no one until its query run ends, holding share-group members.
The agent decides what to do then (it leaves once what it holds is acknowledged: ``Agent.executor_gone``).

Must never: signal or wait on a process other than the one named, or poll for it (a pidfd says when).
"""
from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable

log = logging.getLogger("spark_share.consumers.executor_life")
_ANCESTORS = 4  # a read task runs in a worker forked by pyspark's daemon, which the executor JVM started


def executor_pid() -> int | None:
    """The pid of the JVM above this process (the executor, or in local mode the driver), if any."""
    pid = os.getppid()
    for _ in range(_ANCESTORS):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return None
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if comm == "java":
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])  # the parent: field 4 of /proc/<pid>/stat
        if pid <= 1:
            return None
    return None


def when_gone(pid: int, call: Callable[[], None]) -> bool:
    """Run ``call`` on a thread of its own once process ``pid`` has exited; False if it is already gone
    (``call`` then runs at once) or the kernel has no pidfd (Linux < 5.3: the agent then lives as before)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        call()
        return False
    except (OSError, AttributeError) as e:
        log.info("cannot follow executor pid %d (%s): the agent lives until its query run ends", pid, e)
        return False

    def wait() -> None:
        try:
            select.select([fd], [], [])  # readable once the process has exited
        finally:
            os.close(fd)
        call()

    threading.Thread(target=wait, name="agent-executor-watch", daemon=True).start()
    return True
