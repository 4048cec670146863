"""The executor-side agent: one long-lived process per (query run, host) that owns share consumers.

Owns: the share sessions of this host, the records each (batch, slot) acquired (cached as Arrow
IPC until acknowledged, so every re-read of a batch sees the same rows), and the commands from
the tracker (start a planned batch's polls, queue a batch's acknowledgements and report what the
broker answered, write dead letters, hand a cached batch to another host, shut down).
Read tasks reach it over a Unix socket that only the owner can open, authenticated with the
per-query secret; it reaches the tracker over TCP with the same secret.

Started by the first ``read()`` on a host (``ensure_agent``), detached from the Python worker so
that Spark recycling or killing workers does not take acquired records with it.

Must never: acknowledge anything the tracker did not ask for, poll a session that still holds
records no acknowledgement has been queued for, receive Kafka credentials over a socket (they come
from the read task that starts it, on a pipe), outlive its tracker (when the tracker connection
ends it releases everything and exits).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from . import records, wire

log = logging.getLogger("spark_share.agent")

SPAWN_TIMEOUT_S = 60.0
# A new share consumer must join the group before records flow (a heartbeat interval on a real
# broker): its first poll may wait until it is this old, unless librdkafka reports earlier that it
# joined and fetched (see ShareSession.poll), so an AvailableNow run does not end early.
FIRST_POLL_MIN_MS = 5000
JOIN_SETTLE_S = 1.0


def runtime_dir() -> str:
    """Owner-only directory for sockets, locks, logs and the query registry on this host."""
    base = os.environ.get("SPARK_SHARE_RUNTIME_DIR") or f"/tmp/spark-share-{os.getuid()}"
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.stat(base)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{base} belongs to another user; set SPARK_SHARE_RUNTIME_DIR to a private directory")
    if st.st_mode & 0o077:
        os.chmod(base, 0o700)
    return base


def agent_socket_path(tracker_id: str) -> str:
    return os.path.join(runtime_dir(), f"agent-{tracker_id}.sock")


def checkpoint_note_path(query_id: str) -> str:
    """Where the user's process notes a query's checkpoint location (written when the query starts)."""
    return os.path.join(runtime_dir(), f"checkpoint-{query_id}.json")


# ---------------------------------------------------------------------------------------------
# Read-task side: find or start this host's agent.

def ensure_agent(tracker_addr: Tuple[str, int], tracker_id: str, secret: str, opts,
                 timeout: float = 10.0) -> wire.RpcConnection:
    """Connect to this host's agent for the tracker, starting it if it is not running.

    The Kafka client configs (credentials included) reach a new agent from ``opts``, the options
    Spark shipped with the read task, through a pipe: they never cross a socket of ours.

    Two locks make this safe when Spark kills a worker half way: ``.spawn`` lets one read task at a
    time decide to start an agent; ``.alive`` is taken by the spawner and handed to the agent (an
    inherited file description), so it is held exactly as long as an agent lives, starting or not."""
    path = agent_socket_path(tracker_id)
    try:
        return wire.connect(path, secret, timeout=timeout, name="task")
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    base = os.path.join(runtime_dir(), f"agent-{tracker_id}")
    spawn_fd = os.open(base + ".spawn", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(spawn_fd, fcntl.LOCK_EX)  # released if this worker dies
        alive_fd = os.open(base + ".alive", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(alive_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # an agent lives (maybe still starting): wait for its socket
            os.close(alive_fd)
            return _connect_when_ready(path, secret, timeout)
        try:
            if os.path.exists(path):
                os.unlink(path)  # left by an agent that was killed
            _spawn_agent(tracker_addr, tracker_id, secret, opts, alive_fd)
        finally:
            os.close(alive_fd)  # the agent keeps its own copy of the locked description
        return wire.connect(path, secret, timeout=timeout, name="task")
    finally:
        os.close(spawn_fd)


def _connect_when_ready(path: str, secret: str, timeout: float) -> wire.RpcConnection:
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while True:
        try:
            return wire.connect(path, secret, timeout=timeout, name="task")
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the spark-share agent did not open {path} within {SPAWN_TIMEOUT_S:.0f} s") from None
            time.sleep(0.05)  # bounded poll for a socket file; there is nothing to wait on


def _spawn_agent(tracker_addr, tracker_id: str, secret: str, opts, alive_fd: int) -> None:
    log_path = os.path.join(runtime_dir(), f"agent-{tracker_id}.log")
    env = dict(os.environ)
    # The worker may import this package from a path Spark added (--py-files, a zip); so must the agent.
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + [p for p in sys.path if p and os.path.exists(p)])
    with open(log_path, "ab") as logf:
        os.chmod(log_path, 0o600)
        proc = subprocess.Popen(
            [sys.executable, "-m", "spark_share.agent"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
            close_fds=True, pass_fds=(alive_fd,), start_new_session=True, cwd=runtime_dir(), env=env)
    # Parameters travel on stdin, never on the command line (visible to every user in ps).
    proc.stdin.write(json.dumps({"tracker": list(tracker_addr), "tracker_id": tracker_id, "secret": secret,
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
            raise TimeoutError(f"the spark-share agent did not start within {SPAWN_TIMEOUT_S:.0f} s; see {log_path}")
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        line += chunk
    proc.stdout.close()
    if not line.startswith(b"READY"):
        raise RuntimeError(f"the spark-share agent failed to start: {line.decode(errors='replace').strip() or 'no output'}; see {log_path}")


# ---------------------------------------------------------------------------------------------
# The agent process.

@dataclass
class Cached:
    batch: int
    slot: int
    session: Optional[object]  # ShareSession that holds the records; None when the poll was empty
    ipc: bytes                 # what read tasks get
    rows: int                  # rows read tasks get
    held: int                  # records the session holds for this slot (poison ones included)
    full: Optional[object] = None  # every record acquired, headers included: the dead-letter source
    query_id: Optional[str] = None


def _redelivered(rb) -> int:
    """Rows of a poll that the group delivered before (deliveryCount > 1)."""
    return int((rb.column("deliveryCount").to_numpy() > 1).sum()) if rb.num_rows else 0


class Agent:
    def __init__(self, tracker_addr, tracker_id: str, secret: str, consumer_config: Dict[str, str],
                 producer_config: Dict[str, str], secret_values: List[str]):
        from .options import scrub

        self.tracker_id = tracker_id
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}"
        self._secret = secret
        self._scrub = lambda s: scrub(s, secret_values)
        self._lock = threading.Lock()
        self._resize_lock = threading.Lock()
        self._sessions: List = []
        self._reserved: set = set()
        self._prefetched: Dict[object, object] = {}  # session -> Future of a poll no read has claimed yet
        self._last_taken: Dict[str, Tuple[int, float]] = {}  # session id -> (batch, when) of its last poll
        self._cache: Dict[Tuple[int, int], Cached] = {}
        self._acks: Dict[int, tuple] = {}  # batch -> ({slot: (records held, future)}, timeout) until reported
        self._inflight: Dict[Tuple[int, int], threading.Event] = {}
        self._session_seq = 0
        self.done = threading.Event()
        self.tracker = wire.connect(tuple(tracker_addr), secret, handler=self._on_tracker_request,
                                    on_close=lambda _c: self._tracker_lost(), name="agent-tracker",
                                    scrub=self._scrub)
        hello, _ = self.tracker.call({"op": "hello", "agent_id": self.agent_id, "host": socket.gethostname(),
                                      "pid": os.getpid()}, timeout=30)
        self.config = hello
        self._consumer_config = dict(consumer_config)
        if hello.get("max_poll_records"):
            self._consumer_config["max.poll.records"] = str(min(int(self._consumer_config["max.poll.records"]),
                                                               int(hello["max_poll_records"])))
        self._producer_config = producer_config
        # Dead letters carry the original headers even when the query does not read them.
        self._keep_headers = bool(hello["include_headers"] or hello.get("dead_letter"))
        self._deadletters = None
        if hello.get("dead_letter"):
            from .deadletter import DeadLetterWriter

            # Connected before any session joins: the embedded broker ends every share session
            # when a client drops a connection, as a new producer does with its bootstrap one.
            self._deadletters = DeadLetterWriter(hello.get("dead_letter_topic"), hello.get("dead_letter_path"),
                                                 producer_config)
            self._deadletters.connect()
        self._start_sessions(int(hello.get("slots", 1)))
        self.server = wire.RpcServer(agent_socket_path(tracker_id), secret, self._on_task_request, name="agent",
                                     scrub=self._scrub)

    def _new_session(self, max_poll_records: Optional[int] = None):
        from .session import ShareSession

        with self._lock:
            self._session_seq += 1
            sid = f"{os.getpid()}-{self._session_seq}"
        conf = dict(self._consumer_config)
        if max_poll_records is not None:
            conf["max.poll.records"] = str(max_poll_records)
        return ShareSession(sid, conf, self.config["topics"], self._keep_headers, scrub=self._scrub)

    def _start_sessions(self, n: int, max_poll_records: Optional[int] = None) -> None:
        """Join the group with every session a batch needs before any of them acquires records.

        A member joining later makes the group rebalance; the embedded broker ends the other
        members' share sessions then and hands their acquired records out again (duplicates)."""
        settled = time.monotonic() + JOIN_SETTLE_S
        sessions = [self._new_session(max_poll_records) for _ in range(n)]
        records.warm_up()  # meanwhile: the first conversion's one-time imports (pandas, through pyarrow)
        time.sleep(max(0.0, settled - time.monotonic()))
        with self._lock:
            self._sessions.extend(sessions)
        log.info("agent %s: %d share sessions (max.poll.records %s) joined group %s", self.agent_id, n,
                 sessions[0].max_poll_records if sessions else "-", self._consumer_config.get("group.id"))

    # read tasks ----------------------------------------------------------------------------
    def _on_task_request(self, conn, req: dict, blob: bytes):
        op = req.get("op")
        if op == "read":
            return self._read(int(req["batch"]), int(req["slot"]), req.get("max_records"),
                              int(req.get("poll_timeout_ms", 1000)), req.get("query_id"), req.get("spark_batch"))
        if op == "ping":
            return {"agent_id": self.agent_id, "sessions": len(self._sessions)}, b""
        raise ValueError(f"unknown request {op!r}")

    def _read(self, batch: int, slot: int, max_records, poll_timeout_ms: int, query_id, spark_batch):
        key = (batch, slot)
        while True:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    return {"rows": hit.rows, "cached": True}, hit.ipc
                ev = self._inflight.get(key)
                if ev is None:
                    ev = self._inflight[key] = threading.Event()
                    break
            ev.wait()  # another task of this (batch, slot) is polling: share its result
            with self._lock:
                if key in self._cache:
                    continue
            # the other poll failed; try ourselves
        try:
            claim, _ = self.tracker.call({"op": "claim", "batch": batch, "slot": slot, "query_id": query_id,
                                          "spark_batch": spark_batch}, timeout=60)
            if claim["owner"] is None:  # acquired by an agent that is gone: no new records under this id
                return {"rows": 0, "cached": False, "lost": True}, records.to_ipc(
                    records.empty_batch(self.config["include_headers"]))
            if claim["owner"] != self.agent_id:
                # Another host acquired this (batch, slot): relay its cached rows through the tracker.
                rep, ipc = self.tracker.call({"op": "fetch", "batch": batch, "slot": slot}, timeout=120)
                return {"rows": rep.get("rows", 0), "cached": True, "relayed": True}, ipc
            session, polled = self._take_session(batch, max_records)
            try:
                if polled is None:
                    polled = session.poll(batch, slot, max_records, self._budget(session, poll_timeout_ms))
                rb, holding = polled.result()
                holding.batch, holding.slot = batch, slot
            except BaseException:
                self._give_back(session)
                raise
            acquired = holding.acquired if rb.num_rows else {}
            out, poison = self._visible(rb)
            ipc = records.to_ipc(out)
            # The tracker learns what this (batch, slot) holds before any row of it reaches Spark: a
            # record it does not know of could never be acknowledged nor given a verdict.
            try:
                self.tracker.call({"op": "acquired", "batch": batch, "slot": slot, "session": session.session_id,
                                   "rows": rb.num_rows, "acquired_at": holding.acquired_at, "poison": poison,
                                   "redelivered": _redelivered(rb), "spark_batch": spark_batch,
                                   "offsets": {t: {str(p): runs for p, runs in parts.items()}
                                               for t, parts in acquired.items()}}, timeout=60)
            except BaseException:
                if rb.num_rows:
                    session.release_all(30).result(35)
                self._give_back(session)
                raise
            entry = Cached(batch, slot, session if rb.num_rows else None, ipc, out.num_rows, rb.num_rows,
                           full=rb if self.config.get("dead_letter") else None, query_id=query_id)
            if not rb.num_rows:
                self._give_back(session)
            with self._lock:
                self._cache[key] = entry
            return {"rows": out.num_rows, "cached": False}, ipc
        finally:
            with self._lock:
                ev = self._inflight.pop(key, None)
            if ev is not None:
                ev.set()

    @staticmethod
    def _budget(session, poll_timeout_ms: int) -> int:
        if session.polls:
            return poll_timeout_ms
        # A session's first poll may wait until it is FIRST_POLL_MIN_MS old (it joins meanwhile), or
        # less once librdkafka reports it joined with partitions and fetched since.
        age_ms = (time.monotonic() - session.created_at) * 1000
        return max(poll_timeout_ms, int(FIRST_POLL_MIN_MS - age_ms))

    def _visible(self, rb):
        """What Spark sees of a poll: without records past maxDeliveryCount (reported as poison,
        rejected to the dead-letter target at commit) and without headers unless asked for."""
        poison = []
        limit = self.config.get("max_delivery_count")
        if limit and rb.num_rows:
            import pyarrow as pa

            bad = rb.column("deliveryCount").to_numpy() >= limit
            if bad.any():
                hit = rb.filter(pa.array(bad))
                poison = [[t, p, o, c] for t, p, o, c in zip(*(hit.column(n).to_pylist() for n in
                                                               ("topic", "partition", "offset", "deliveryCount")))]
                rb = rb.filter(pa.array(~bad))
        if not self.config["include_headers"] and "headers" in rb.schema.names:
            rb = rb.drop_columns(["headers"])
        return rb, poison

    def _take_session(self, batch: int, max_records: Optional[int]):
        """Reserve a session for a read of ``batch``: (session, its prefetched poll or None).

        A session that polled ahead for this batch (``prefetch``) comes first; otherwise a free
        session whose polls are no bigger than ``max_records``.

        Sessions not yet polled in this batch come first, then the longest unpolled: the broker
        gives each member its own partitions, so a session that is never polled leaves its
        partitions unread (an empty poll frees a session at once, and reusing it for the next slot
        starved the others and ended AvailableNow runs early).

        When the tracker lowers the batch size (after lock expiry), every free session is replaced
        by one with a smaller max.poll.records, all at once: trimming a bigger poll would mean
        releasing the excess, and every release counts as a delivery."""
        with self._resize_lock:
            with self._lock:
                free = self._free_sessions()
                if max_records is not None and any(s.max_poll_records > max_records for s in free):
                    for s in free:
                        self._sessions.remove(s)
                        self._last_taken.pop(s.session_id, None)
                    stale = free
                    free = []
                else:
                    stale = []
            if stale:
                wait_futures([s.close() for s in stale], timeout=30)
                self._start_sessions(len(stale), max_records)
                log.info("agent %s: batch size lowered: polls now take at most %d records", self.agent_id, max_records)
            with self._lock:
                fits = [s for s in self._prefetched if s not in self._reserved] + self._free_sessions(max_records)
                if fits:
                    s = min(fits, key=lambda s: (s not in self._prefetched, self._poll_order(s, batch)))
                    self._reserve(s, batch)
                    return s, self._prefetched.pop(s, None)
        s = self._new_session(max_records)
        with self._lock:
            self._sessions.append(s)
            self._reserve(s, batch)
        log.info("agent %s: started share session %s", self.agent_id, s.session_id)
        return s, None

    def _prefetch(self, batch: int, count: int, max_records: Optional[int], poll_timeout_ms: int) -> dict:
        """Start the polls of ``batch`` on up to ``count`` free sessions now, while Spark still
        writes its offsets and schedules the read tasks: the reads then find them done or under
        way. A poll no read of this batch claims is claimed by the next one (its records stay
        held until then, and are released if the query stops)."""
        with self._lock:
            chosen = sorted(self._free_sessions(max_records), key=lambda s: self._poll_order(s, batch))[:count]
            for s in chosen:
                self._prefetched[s] = s.poll(batch, -1, max_records, self._budget(s, poll_timeout_ms))
                self._last_taken[s.session_id] = (batch, time.monotonic())
        return {"polling": len(chosen)}

    def _free_sessions(self, max_records: Optional[int] = None) -> List:
        """Sessions no read holds, with no poll started ahead and nothing awaiting an acknowledgement
        (polls no bigger than ``max_records``, if given). Call with ``_lock`` held."""
        return [s for s in self._sessions if s not in self._reserved and not s.busy and s not in self._prefetched
                and (max_records is None or s.max_poll_records <= max_records)]

    def _poll_order(self, session, batch: int) -> Tuple[bool, float]:
        last_batch, when = self._last_taken.get(session.session_id, (-1, 0.0))
        return last_batch == batch, when

    def _reserve(self, session, batch: int) -> None:
        self._reserved.add(session)
        self._last_taken[session.session_id] = (batch, time.monotonic())

    def _give_back(self, session) -> None:
        with self._lock:
            self._reserved.discard(session)

    # tracker commands -----------------------------------------------------------------------
    def _on_tracker_request(self, conn, req: dict, blob: bytes):
        op = req.get("op")
        if op == "ack":
            return self._ack(int(req["batch"]), req.get("verdicts") or [], int(req.get("default", 1)),
                             float(req.get("timeout_s", 30))), b""
        if op == "ack_result":
            return self._ack_result(int(req["batch"])), b""
        if op == "prefetch":
            return self._prefetch(int(req["batch"]), int(req["count"]), req.get("max_records"),
                                  int(req.get("poll_timeout_ms", 1000))), b""
        if op == "deadletter":
            return self._dead_letter(int(req["batch"]), req["records"]), b""
        if op == "fetch":
            with self._lock:
                hit = self._cache.get((int(req["batch"]), int(req["slot"])))
            if hit is None:
                raise KeyError(f"batch {req['batch']} slot {req['slot']} is not cached here")
            return {"rows": hit.rows}, hit.ipc
        if op == "shutdown":
            threading.Thread(target=self.shutdown, name="agent-shutdown", daemon=True).start()
            return {"ok": True}, b""
        if op == "ping":
            return {"agent_id": self.agent_id}, b""
        raise ValueError(f"unknown command {op!r}")

    def _dead_letter(self, batch: int, wanted: list) -> dict:
        """Write the rejected records of ``batch`` held here to the dead-letter target."""
        from .deadletter import rejected_table

        want = {(t, int(p), int(o)): reason for t, p, o, reason in wanted}
        with self._lock:
            entries = [e for (b, _), e in self._cache.items() if b == batch and e.full is not None]
        written = 0
        for e in entries:
            table = rejected_table(e.full, want, e.query_id, batch)
            written += self._deadletters.write(table, batch, f"{self.tracker_id}-slot{e.slot}")
        return {"written": written}

    def _ack(self, batch: int, verdicts: list, default: int, timeout_s: float) -> dict:
        """Queue the acknowledgement of every slot of ``batch`` held here (``default`` unless a
        verdict says otherwise) on the consumers that acquired them, ahead of their next poll, and
        return: ``ack_result`` reports what the broker answered."""
        from .session import ACCEPT

        vmap = {(t, int(p), int(o)): int(k) for t, p, o, k, *_ in verdicts}
        with self._lock:
            entries = [e for (b, _), e in self._cache.items() if b == batch]
            futs = {}
            for e in entries:
                self._cache.pop((e.batch, e.slot), None)
                if e.session is None:
                    continue
                if default == ACCEPT:
                    futs[e.slot] = (e.held, e.session.acknowledge(vmap, timeout_s))
                else:
                    futs[e.slot] = (e.held, e.session.release_all(timeout_s))
                self._reserved.discard(e.session)  # free for the next batch: its poll queues behind this
            self._acks[batch] = (futs, timeout_s)
        return {"queued": len(futs)}

    def _ack_result(self, batch: int) -> dict:
        with self._lock:
            futs, timeout_s = self._acks.pop(batch, ({}, 0.0))
        wait_futures([f for _, f in futs.values()], timeout=timeout_s + 5)
        out = {}
        for slot, (held, f) in futs.items():
            try:
                out[str(slot)] = f.result(timeout=0).as_dict()
            except Exception as ex:
                out[str(slot)] = {"failed": held, "errors": {type(ex).__name__: held}}
        return {"slots": out}

    # lifecycle ------------------------------------------------------------------------------
    def _tracker_lost(self) -> None:
        if not self.done.is_set():
            log.warning("agent %s: tracker connection ended; releasing all records and exiting", self.agent_id)
            self.shutdown()

    def shutdown(self) -> None:
        with self._lock:
            if self.done.is_set():
                return
            sessions = list(self._sessions)
            self._sessions.clear()
        try:
            self.server.close()
        except Exception:
            pass
        # close() releases whatever a session still holds, at once.
        futs = [s.close() for s in sessions]
        wait_futures(futs, timeout=30)
        if self._deadletters is not None:
            self._deadletters.close()
        self.tracker.close()
        self.done.set()


def main() -> None:
    params = json.loads(sys.stdin.readline())
    # Detach: the intermediate process exits, the agent is re-parented and survives the worker.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        agent = Agent(params["tracker"], params["tracker_id"], params["secret"], params["consumer_config"],
                      params["producer_config"], params["secret_values"])
    except Exception as e:
        from .options import scrub

        why = scrub(f"{type(e).__name__}: {e}", params["secret_values"])
        log.error("agent failed to start: %s", why)
        sys.stdout.write(f"ERROR {why}\n")
        sys.stdout.flush()
        os._exit(1)
    try:
        sys.stdout.write(f"READY {agent.agent_id}\n")
        sys.stdout.flush()
    except OSError:  # the worker that started us was killed meanwhile; we serve its retry
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    agent.done.wait()
    for suffix in (".spawn", ".alive"):  # no spawner can want this run's locks any more: its tracker is gone
        try:
            os.unlink(os.path.join(runtime_dir(), f"agent-{params['tracker_id']}{suffix}"))
        except OSError:
            pass
    log.info("agent %s: exiting", agent.agent_id)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
