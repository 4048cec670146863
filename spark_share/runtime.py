"""Where spark-share keeps files on a host: the driver host's runtime directory (the query registry,
the tracker's files) and an executor's agent directory; logging.

Owns: the owner-only runtime directory (``SPARK_SHARE_RUNTIME_DIR``, else ``/tmp/spark-share-<uid>``), the
agent directory of an executor (its first Spark local dir: per application, removed by Spark), the name
of every file in them (spawn and liveness locks, logs, query registry entries, checkpoint notes) and of
an agent's socket (abstract: no file), writing and reading the registry entry through which the user's
process finds a query's tracker, removing what no live process owns, and the log handlers of our processes.

Must never: import the agent, the tracker or Spark (every process of ours uses it), or write a
file other users can read (registry entries hold the per-query secret).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import threading
import time
from logging.handlers import RotatingFileHandler

from .errors import RuntimeDirError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_RETENTION_S = 7 * 86400
LOG_MAX_BYTES = 10 << 20  # a tracker log rotates at this size...
LOG_BACKUPS = 3  # ...keeping this many older files
AGENT_LOG_RUNS = 20  # the agent logs of this many query runs are kept on a host (their own rotation caps each)
SAFE_ID = re.compile(r"[0-9a-f]{16}")  # a tracker id (it names files here)
ORPHAN_AGE_S = 3600.0  # an agent's lock files unused this long, with no holder, are removed
ABSTRACT_PREFIX = "spark-share-agent-"  # of every agent's socket name (tests find agents by it)


def runtime_dir() -> str:
    """Owner-only directory for sockets, locks, logs and the query registry on this host."""
    base = os.environ.get("SPARK_SHARE_RUNTIME_DIR") or f"/tmp/spark-share-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    if st.st_uid != os.getuid():
        raise RuntimeDirError(f"{base} belongs to another user; set SPARK_SHARE_RUNTIME_DIR to a private directory")
    if st.st_mode & 0o077:
        os.chmod(base, 0o700)
    return base


def agent_dir() -> str:
    """Where an executor's agent keeps its files: the executor's first Spark local dir, which Spark gives
    its Python processes (``SPARK_LOCAL_DIRS``: ``spark.local.dir``, YARN's container dirs, a Kubernetes
    pod's volume). It belongs to one application (one executor) and Spark removes it, so one user's
    applications share nothing and a read-only root costs nothing. A ``SPARK_SHARE_RUNTIME_DIR`` the user
    set wins (to keep agents' logs past the application); outside Spark, the runtime directory."""
    if os.environ.get("SPARK_SHARE_RUNTIME_DIR"):
        return runtime_dir()
    for d in (os.environ.get("SPARK_LOCAL_DIRS") or "").split(","):
        if d and os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return d
    return runtime_dir()


# --- file names ---------------------------------------------------------------------------------
def agent_base(tracker_id: str) -> str:
    """Prefix of the agent's files of one query run in this executor: ``.spawn``, ``.alive``, ``.log``."""
    return os.path.join(agent_dir(), f"agent-{tracker_id}")


def agent_address(tracker_id: str) -> str:
    """The agent's Unix socket, in the abstract namespace: no file to leave behind or to fit in 108 bytes
    (a local dir's path is longer), gone with the agent. Any local process may connect; only a peer that
    proves the query's secret is admitted (``endpoints``). Named by the run and by the agent directory:
    each executor of a host has its own agent."""
    where = hashlib.sha256(os.path.realpath(agent_dir()).encode()).hexdigest()[:16]
    return f"\0{ABSTRACT_PREFIX}{tracker_id}-{where}"


def agent_log_path(tracker_id: str) -> str:
    return agent_base(tracker_id) + ".log"


def tracker_log_path(tracker_id: str) -> str:
    return os.path.join(runtime_dir(), f"tracker-{tracker_id}.log")


def tracker_lock_path(tracker_id: str) -> str:
    """A lock the tracker holds for its life: its agents' files are orphans once nobody holds it."""
    return os.path.join(runtime_dir(), f"tracker-{tracker_id}.alive")


def hold_tracker_lock(tracker_id: str) -> int:
    """Take the tracker's life lock (see ``tracker_lock_path``); the kernel drops it if we are killed."""
    import fcntl

    fd = os.open(tracker_lock_path(tracker_id), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def release_tracker_lock(tracker_id: str, fd: int) -> None:
    remove(tracker_lock_path(tracker_id))
    os.close(fd)


def tracker_alive(tracker_id: str) -> bool:
    """Does a tracker of this host with this id still run (it holds its life lock)?"""
    return _lock_held(tracker_lock_path(tracker_id))


def _lock_held(path: str) -> bool:
    """Does a live process hold the life lock at ``path`` (a tracker's, or an agent's ``.alive``)?"""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True  # held: its process runs
    finally:
        os.close(fd)
    return False


def registry_path(query_id: str) -> str:
    """Where a query's tracker leaves its address and secret for the user's process on this host."""
    return os.path.join(runtime_dir(), f"query-{query_id}.json")


def run_registry_path(tracker_id: str) -> str:
    """Where a tracker leaves its address and secret under its own id (it does not know its query
    id until a read or the listener names it; foreachBatch under Spark Connect finds it here)."""
    return os.path.join(runtime_dir(), f"run-{tracker_id}.json")


def final_counts_path(query_id: str) -> str:
    """Where a query run's tracker leaves its final counts when it stops (``status()`` of an ended query:
    on Spark < 4.2 no progress report carries them)."""
    return os.path.join(runtime_dir(), f"final-{query_id}.json")


def run_end_path(tracker_id: str) -> str:
    """Where a query run's tracker says, when it stops, whether its consumers closed (left the group, their
    records released): a later run replaying its batch need not wait for them to be dropped. Pruned with the
    final counts."""
    return os.path.join(runtime_dir(), f"final-run-{tracker_id}.json")


def checkpoint_note_path(query_id: str) -> str:
    """Where the user's process notes a query's checkpoint location (written when the query starts)."""
    return os.path.join(runtime_dir(), f"checkpoint-{query_id}.json")


# --- owner-only JSON files ----------------------------------------------------------------------
def write_private_json(path: str, content: dict) -> None:
    """Write ``content`` readable by this user only, replacing ``path`` atomically."""
    # A temporary name of this writer's own: two trackers of one query (two kafka-share sources) write the
    # same entry at once, and with a shared one the second replace found it gone (FileNotFoundError).
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def remove(path: str | None) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


# --- the query registry -------------------------------------------------------------------------
def registry_entry(query_id: str) -> dict | None:
    """The registry entry of a query on this host (its tracker may be gone)."""
    return read_json(registry_path(query_id))


def live_registry_entry(query_id: str) -> dict | None:
    """The registry entry of a query if the tracker that wrote it still runs."""
    reg = registry_entry(query_id)
    try:
        os.kill(int(reg["pid"]), 0)  # type: ignore[index]
        return reg
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_run_entry(tracker_id: str) -> dict | None:
    """The registry entry of a tracker by its id, if it still runs."""
    if not SAFE_ID.fullmatch(tracker_id or "") or not tracker_alive(tracker_id):
        return None
    return read_json(run_registry_path(tracker_id))


def live_run_entries() -> list[dict]:
    """The registry entries of every tracker that runs on this host."""
    names = [n for n in os.listdir(runtime_dir()) if n.startswith("run-") and n.endswith(".json")]
    found = (live_run_entry(n[len("run-"):-len(".json")]) for n in sorted(names))
    return [e for e in found if e is not None]


# --- housekeeping and logs ----------------------------------------------------------------------
def prune(max_age_s: float = LOG_RETENTION_S, orphan_age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove what no live process of ours owns (run when a tracker starts): logs untouched for a
    week, registry entries of trackers that are gone, checkpoint notes and final counts of queries long
    gone, the lock files of killed agents (at once when their tracker is gone too, else an hour on: a
    live tracker may start a new agent), the life locks of killed trackers, and TLS key files left by a
    process killed while loading one (``transport.tls``). Returns the names removed."""
    base = runtime_dir()
    now = time.time()
    removed = []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        try:
            age = now - os.stat(path).st_mtime
        except OSError:
            continue
        gone = False
        if name.endswith(".log") or ".log." in name:  # rotated logs too
            gone = age > max_age_s
        elif name.startswith("query-") and name.endswith(".json"):
            gone = live_registry_entry(name[len("query-"):-len(".json")]) is None
        elif name.startswith("run-") and name.endswith(".json"):
            gone = not tracker_alive(name[len("run-"):-len(".json")])
        elif (name.startswith("checkpoint-") or name.startswith("final-")) and name.endswith(".json"):
            query_id = name[name.index("-") + 1:-len(".json")]
            gone = age > max_age_s and live_registry_entry(query_id) is None
        elif name.startswith("agent-"):
            continue  # prune_agent_files, below
        elif name.startswith("tracker-") and name.endswith(".alive"):
            gone = not tracker_alive(name[len("tracker-"):-len(".alive")])
        elif name.startswith("tls-") and name.endswith(".pem"):  # a key file whose loader was killed mid-load
            gone = age > 60
        if gone:
            remove(path)
            removed.append(name)
    removed += prune_agent_files(max_age_s, orphan_age_s, base)
    if agent_dir() != base:  # local mode: this process's agent keeps its files in the driver's local dir
        removed += prune_agent_files(max_age_s, orphan_age_s)
    return removed


def prune_agent_files(max_age_s: float = LOG_RETENTION_S, orphan_age_s: float = ORPHAN_AGE_S,
                      base: str | None = None) -> list[str]:
    """Remove what agents of ended runs left in an agent directory (``agent_dir()`` unless ``base``; run when
    an agent or a tracker starts: an executor may never see a tracker): the lock files of killed agents
    (at once when their tracker is gone or elsewhere, else an hour on), and agent logs untouched for a
    week or beyond the newest ``AGENT_LOG_RUNS`` runs' whose agents have ended."""
    base = base or agent_dir()
    now = time.time()
    removed = []
    logs: dict[str, list[tuple[float, str]]] = {}
    for name in sorted(os.listdir(base)):
        if not name.startswith("agent-"):
            continue
        path = os.path.join(base, name)
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            continue
        if name.endswith(".spawn"):
            if now - mtime > orphan_age_s or not tracker_alive(name[len("agent-"):-len(".spawn")]):
                removed += _remove_orphan_agent_files(path[:-len(".spawn")])
        elif name.endswith(".sock") and not _lock_held(path[:-len(".sock")] + ".alive"):
            remove(path)  # a socket file of a version before abstract sockets
            removed.append(name)
        elif ".log" in name:
            logs.setdefault(name[:name.index(".log")], []).append((mtime, name))
    newest_first = sorted(logs, key=lambda run: max(logs[run]), reverse=True)
    for i, run in enumerate(newest_first):
        last_write = max(logs[run])[0]
        if (i >= AGENT_LOG_RUNS or now - last_write > max_age_s) and not _lock_held(os.path.join(base, run) + ".alive"):
            for _, name in logs[run]:
                remove(os.path.join(base, name))
                removed.append(name)
    return removed


def _remove_orphan_agent_files(base: str) -> list[str]:
    """An agent's files, if no agent and no spawner holds their locks (the agent was killed)."""
    import fcntl

    fds = []
    try:
        for suffix in (".spawn", ".alive"):  # the order a spawner takes them in
            fd = os.open(base + suffix, os.O_RDWR)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (an agent lives or is starting), or already gone
        for fd in fds:
            os.close(fd)
        return []
    try:
        for suffix in (".alive", ".spawn"):
            remove(base + suffix)
    finally:
        for fd in fds:
            os.close(fd)
    name = os.path.basename(base)
    return [name + s for s in (".alive", ".spawn")]


class _OwnerOnlyRotatingFile(RotatingFileHandler):
    """Every file it opens, the first and each one after a rotation, is readable by this user only."""

    def _open(self):
        return open(self.baseFilename, self.mode, encoding=self.encoding,
                    opener=lambda path, flags: os.open(path, flags, 0o600))


def log_to_file(path: str) -> logging.Handler:
    """Also send spark_share's log lines to an owner-only file, rotated by size (a stream runs for
    weeks); the caller removes the handler."""
    h = _OwnerOnlyRotatingFile(path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS)
    h.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("spark_share").addHandler(h)
    return h


def stop_logging_to(handler: logging.Handler) -> None:
    logging.getLogger("spark_share").removeHandler(handler)
    handler.close()


def log_to_stderr() -> None:
    """spark_share's INFO lines to stderr, once per process (Spark's Python processes set up none)."""
    root = logging.getLogger("spark_share")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


class _RotatingStderrFile(logging.StreamHandler):
    """Lines to stderr, which is the log file at ``path``: past ``LOG_MAX_BYTES`` it is renamed (the last
    ``LOG_BACKUPS`` kept) and a new file takes over descriptor 2, so that what the process's C libraries
    and Python's own error paths print there rotates with our lines."""

    def __init__(self, path: str):
        super().__init__(sys.stderr)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:
            if os.fstat(2).st_size > LOG_MAX_BYTES:
                self._rotate()
        except OSError:
            pass  # a full disk: the lines we cannot write are lost, the process goes on

    def _rotate(self) -> None:
        for i in range(LOG_BACKUPS - 1, 0, -1):
            if os.path.exists(f"{self.path}.{i}"):
                os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
        os.replace(self.path, self.path + ".1")
        fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o600)
        try:
            sys.stderr.flush()
            os.dup2(fd, 2)
        finally:
            os.close(fd)


def log_to_rotating_stderr(path: str) -> None:
    """For a process whose stderr is the log file at ``path`` (an agent: its spawner opened it): spark_share's
    INFO lines there, rotated by size like the tracker's (an agent lives as long as its query run: weeks)."""
    root = logging.getLogger("spark_share")
    h = _RotatingStderrFile(path)
    h.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False
