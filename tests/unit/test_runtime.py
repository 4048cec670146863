"""The runtime directory stays bounded: rotated logs, and files of processes that are gone removed."""
import fcntl
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from spark_share import runtime
from spark_share.executor import read_task


@pytest.fixture
def rdir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def touch(path, age_s=0.0, text="{}"):
    path.write_text(text)
    t = time.time() - age_s
    os.utime(path, (t, t))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_prune_removes_what_no_live_process_owns_and_keeps_the_rest(rdir):
    week, hour = runtime.LOG_RETENTION_S, runtime.ORPHAN_AGE_S
    touch(rdir / "query-dead.json", text=f'{{"pid": {dead_pid()}}}')
    touch(rdir / "query-live.json", text=f'{{"pid": {os.getpid()}}}')
    touch(rdir / "checkpoint-dead.json", age_s=week + 60)
    touch(rdir / "checkpoint-live.json", age_s=week + 60)
    touch(rdir / "checkpoint-recent.json")
    touch(rdir / "tracker-old.log", age_s=week + 60)
    touch(rdir / "tracker-old.log.2", age_s=week + 60)
    touch(rdir / "tracker-new.log")
    # "young": killed a moment ago, its tracker lives (it may start a new agent); "orphan": killed a
    # moment ago with its tracker; "killed": an hour ago; "alive": runs. Their ".sock" files are what
    # agents before abstract sockets left: gone once no agent holds the lock.
    for agent in ("killed", "alive", "young", "orphan"):
        for suffix in (".spawn", ".alive", ".sock"):
            touch(rdir / f"agent-{agent}{suffix}", age_s=0 if agent in ("young", "orphan") else 2 * hour)
    touch(rdir / "tracker-orphan.alive")  # a tracker killed: nobody holds its lock
    touch(rdir / "tls-left.pem", age_s=120)  # a key file whose loader was killed mid-load
    touch(rdir / "tls-loading.pem")  # one being loaded now
    held = os.open(rdir / "agent-alive.alive", os.O_RDWR)  # what a running agent holds
    fcntl.flock(held, fcntl.LOCK_EX)
    tracker = runtime.hold_tracker_lock("young")  # what a running tracker holds
    try:
        removed = runtime.prune()
    finally:
        os.close(held)
    assert sorted(removed) == sorted(["query-dead.json", "checkpoint-dead.json", "tracker-old.log",
                                      "tracker-old.log.2", "tracker-orphan.alive", "tls-left.pem"]
                                     + [f"agent-{a}{s}" for a in ("killed", "orphan") for s in (".sock", ".alive", ".spawn")]
                                     + ["agent-young.sock"])
    assert sorted(p.name for p in rdir.iterdir()) == sorted(
        ["query-live.json", "checkpoint-live.json", "checkpoint-recent.json", "tracker-new.log", "tracker-young.alive",
         "tls-loading.pem", "agent-alive.sock", "agent-young.spawn", "agent-young.alive"]
        + [f"agent-alive{s}" for s in (".spawn", ".alive")])
    runtime.release_tracker_lock("young", tracker)
    assert not (rdir / "tracker-young.alive").exists()


def test_the_tracker_log_rotates_by_size(rdir, monkeypatch):
    monkeypatch.setattr(runtime, "LOG_MAX_BYTES", 2000)
    monkeypatch.setattr(runtime, "LOG_BACKUPS", 2)
    path = runtime.tracker_log_path("t1")
    h = runtime.log_to_file(path)
    log = logging.getLogger("spark_share.test")
    level = logging.getLogger("spark_share").level
    logging.getLogger("spark_share").setLevel(logging.INFO)
    try:
        for i in range(500):
            log.info("line %d of a stream that runs for weeks", i)
    finally:
        runtime.stop_logging_to(h)
        logging.getLogger("spark_share").setLevel(level)
    files = sorted(p.name for p in rdir.iterdir())
    assert files == ["tracker-t1.log", "tracker-t1.log.1", "tracker-t1.log.2"]
    assert all((rdir / f).stat().st_size <= 2000 for f in files)
    assert all((rdir / f).stat().st_mode & 0o077 == 0 for f in files)
    assert "line 499 " in (rdir / "tracker-t1.log").read_text()


def test_a_worker_forgets_agent_connections_of_ended_runs(monkeypatch):
    ended, live = SimpleNamespace(closed=True), SimpleNamespace(closed=False)
    monkeypatch.setattr(read_task, "_AGENTS", {"run-1": ended, "run-2": live})
    assert read_task._agent_of("run-1") is None and read_task._agent_of("run-2") is live
    assert read_task._AGENTS == {"run-2": live}


def test_an_agents_log_rotates_with_what_its_libraries_print_to_stderr(rdir):
    """An agent's stderr is its log (the spawner opened it): spark_share's lines and what C libraries or
    Python's error paths print on descriptor 2 rotate together, the files capped in size and number."""
    path = runtime.agent_log_path("0123456789abcdef")
    script = (
        "import logging, os\n"
        "from spark_share import runtime\n"
        "runtime.LOG_MAX_BYTES, runtime.LOG_BACKUPS = 2000, 2\n"
        f"runtime.log_to_rotating_stderr({path!r})\n"
        "log = logging.getLogger('spark_share.agent')\n"
        "for i in range(500):\n"
        "    log.info('line %d of an agent that runs for weeks', i)\n"
        "    if i % 50 == 0:\n"
        "        os.write(2, b'a line printed by a C library\\n')\n"
        "os.write(2, b'the last C line\\n')\n")
    with open(path, "ab") as stderr:
        subprocess.run([sys.executable, "-c", script], stderr=stderr, check=True, timeout=60)
    files = sorted(p.name for p in rdir.iterdir())
    assert files == ["agent-0123456789abcdef.log", "agent-0123456789abcdef.log.1", "agent-0123456789abcdef.log.2"]
    assert all((rdir / f).stat().st_size <= 2000 + 200 for f in files), "capped: one line past the size at most"
    assert all((rdir / f).stat().st_mode & 0o077 == 0 for f in files[1:])
    current = (rdir / files[0]).read_text()
    assert "line 499 " in current and current.endswith("the last C line\n")


def test_an_agent_start_removes_what_ended_runs_left_and_keeps_recent_logs(rdir, monkeypatch):
    monkeypatch.setattr(runtime, "AGENT_LOG_RUNS", 2)
    hour = runtime.ORPHAN_AGE_S
    for i, run in enumerate(["old1", "old2", "new1", "new2"]):  # oldest first
        touch(rdir / f"agent-{run}.log", age_s=(4 - i) * 60)
    touch(rdir / "agent-old1.log.1", age_s=300)
    touch(rdir / "agent-week.log", age_s=runtime.LOG_RETENTION_S + 60)
    for suffix in (".spawn", ".alive", ".sock"):
        touch(rdir / f"agent-killed{suffix}", age_s=2 * hour)
        touch(rdir / f"agent-live{suffix}", age_s=2 * hour)
    touch(rdir / "agent-live.log", age_s=3600)  # an old log, but its agent still runs
    touch(rdir / "tracker-t.log")  # a tracker's files are not an agent's to remove
    held = os.open(rdir / "agent-live.alive", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        removed = runtime.prune_agent_files()
    finally:
        os.close(held)
    assert sorted(removed) == sorted(["agent-old1.log", "agent-old1.log.1", "agent-old2.log", "agent-week.log",
                                      "agent-killed.sock", "agent-killed.alive", "agent-killed.spawn"])
    assert sorted(p.name for p in rdir.iterdir()) == sorted(
        ["agent-new1.log", "agent-new2.log", "agent-live.log", "tracker-t.log"]
        + [f"agent-live{s}" for s in (".spawn", ".alive", ".sock")])
