"""The executor-side agent: one long-lived process per (query run, executor) that owns share consumers.

Owns: the share sessions of this executor (which one a read polls with: ``pool``), the records each
(batch, slot) acquired (cached as Arrow IPC until acknowledged, so every re-read of a batch sees the same
rows; past ``agentCacheBytes`` in the executor's local dir: ``spill``), and the tracker's commands (start a
planned batch's polls, hand a cached batch to another host, shut down; its acknowledgements and dead
letters are ``agent_acks``'). Read tasks reach it over an abstract Unix socket, admitted with the
per-query secret; it reaches the tracker over TCP with the same secret. Under readMode=driver it runs as
threads of the source runner, without its socket.

Started by the first ``read()`` in an executor (``launcher.ensure_agent``; in local mode by the source
runner when the query starts), detached from the Python worker so that Spark recycling or killing
workers does not take acquired records with it; it leaves once its executor is gone and what it holds
is acknowledged (``executor_life``).

Must never: acknowledge anything the tracker did not ask for, poll a session that still holds
records no acknowledgement has been queued for, receive Kafka credentials over a socket (they come
from the read task that starts it, on a pipe), outlive its tracker (when the tracker connection
ends it releases everything and exits).
"""
from __future__ import annotations

import gc
import json
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import wait as wait_futures

from .. import runtime
from ..errors import BatchRefused, MemberRefused, PeerConnectionError
from ..options import sized
from ..record_ranges import RecordSorter
from ..transport import endpoints, wire
from ..transport.bundler import Bundler
from ..transport.protocol import (
    TASK_TO_AGENT,
    TRACKER_TO_AGENT,
    Acquired,
    Claim,
    Fetch,
    Hello,
    Member,
    More,
    Ping,
    Prefetch,
    Read,
    Shutdown,
    Trim,
    call,
    dispatcher,
)
from . import executor_life, records
from .agent_acks import AgentAcknowledgements, Cached
from .pool import SessionPool, poll_budget
from .session_stats import stats_interval_ms
from .spill import DEFAULT_BYTES as DEFAULT_CACHE_BYTES
from .spill import SpillBudget

log = logging.getLogger("spark_share.consumers.agent")
CLOSE_WAIT_S = 30.0  # at shutdown, for the consumers to close (their releases wait for the broker)
CONNECT_WAIT_S = 30.0  # a new agent tries to reach its tracker this long...
CONNECT_ATTEMPT_S = 2.0  # ...in attempts of this long
MORE_TIMEOUT_S = 10.0  # a read asks the tracker how many records beyond its grant it may hand out, this long


class Agent(AgentAcknowledgements):
    def __init__(self, tracker_addr, tracker_id: str, secret: str, consumer_config: dict[str, str],
                 producer_config: dict[str, str], secret_values: list[str], alive_fd: int | None = None,
                 serve: bool = True, sorter: RecordSorter | None = None):
        from ..options import scrub

        self.tracker_id = tracker_id
        self.alive_fd = alive_fd  # the host's life lock of this run's agent (see launcher), held until _leave_host
        self.agent_id = f"{socket.gethostname()}:{os.getpid()}"
        self._secret = secret
        self._scrub = lambda s: scrub(s, secret_values)
        self._lock = threading.Lock()
        self.pool = SessionPool(self._new_session, name=f"agent {self.agent_id}")
        # readMode=driver: what its sessions sort polls by (committed and replayed records: record_ranges)
        self.sorter = sorter if sorter is not None else RecordSorter()
        self._cache: dict[tuple[int, int], Cached] = {}
        self._acks: dict[int, tuple] = {}  # batch -> ({slot: (records held, future)}, timeout) until reported
        self._staged: dict[tuple[int, str], list] = {}  # (batch, purpose) -> verdict chunks before their request
        self._inflight: dict[tuple[int, int], threading.Event] = {}
        self._session_seq = 0
        self._shutting_down = False
        self._orphaned = False  # its executor exited: it leaves once what it holds is acknowledged
        self.done = threading.Event()
        self._deadletters = None
        self.server: endpoints.RpcServer | None = None  # with ``serve``, once it has joined
        # An Ack is queued on the consumers on the wire's loop, as it arrives: the tracker does not wait
        # for it (at scale that wait was most of latestOffset), and a claim's answer, which comes behind
        # it on this connection, finds the sessions it frees free.
        self.tracker = _connect_tracker(tracker_addr, secret, handler=dispatcher(self, TRACKER_TO_AGENT),
                                        on_close=lambda _c: self._tracker_lost(), name="agent-tracker",
                                        scrub=self._scrub, inline=lambda header: header.get("op") in ("stage", "ack"))
        self.reads = Bundler(self.tracker)  # this host's reads' Claims and Acquireds, bundled when they meet
        try:  # refused (its tracker began to stop), unanswered, or its socket taken: it leaves, holding nothing
            hello, _ = call(self.tracker, Hello(self.agent_id, socket.gethostname(), os.getpid()), timeout=30)
            self.config = hello
            self.tracker.set_keepalive(float(hello["dead_after_s"]))  # a tracker gone silent is a tracker gone
            self._consumer_config = sized(consumer_config, hello.get("max_poll_records"))
            self._consumer_config.setdefault("statistics.interval.ms", str(stats_interval_ms(int(hello["partitions"]))))
            self._producer_config = producer_config
            # Dead letters carry the original headers even when the query does not read them.
            self._keep_headers = bool(hello["include_headers"] or hello.get("dead_letter"))
            if hello.get("dead_letter"):
                from .deadletter import DeadLetterWriter

                # Connected before any session joins: the embedded broker ends every share session
                # when a client drops a connection, as a new producer does with its bootstrap one.
                self._deadletters = DeadLetterWriter(hello.get("dead_letter_topic"), hello.get("dead_letter_path"),
                                                     producer_config)
                self._deadletters.connect()
            self.pool.start(int(hello.get("slots", 1)))
            # Batches wait for their acknowledgement here, past the budget in the executor's local dir. Without
            # ``serve`` (readMode=driver, in the source runner) rows go in Spark's task payloads; no read task comes.
            limit = DEFAULT_CACHE_BYTES if hello.get("cache_bytes") is None else int(hello["cache_bytes"])
            self._budget = SpillBudget(limit, runtime.agent_dir()) if serve else None
            self.server = endpoints.RpcServer(runtime.agent_address(tracker_id), secret, dispatcher(self, TASK_TO_AGENT),
                                              name="agent", scrub=self._scrub) if serve else None
        except BaseException:
            self.shutdown()
            raise

    def _new_session(self, max_poll_records: int | None = None, replay: bool = False):
        from .session import ShareSession

        with self._lock:
            self._session_seq += 1
            sid = f"{os.getpid()}-{self._session_seq}"
        conf = dict(self._consumer_config)
        if max_poll_records is not None:
            conf["max.poll.records"] = str(max_poll_records)
        return ShareSession(sid, conf, self.config["topics"], self._keep_headers, scrub=self._scrub,
                            held_elsewhere=self.pool.held_elsewhere, sorter=self.sorter, replay=replay)

    # read tasks ----------------------------------------------------------------------------
    def _on_read(self, conn, m: Read):
        return self.read_slot(m.batch, m.slot, m.max_records, m.poll_timeout_ms, m.query_id, m.spark_batch, m.connect_session)

    def _on_ping(self, conn, m: Ping) -> dict:
        with self._lock:
            cached = len(self._cache)
        b = self._budget
        return {"agent_id": self.agent_id, "sessions": len(self.pool), "cached": cached,
                "cached_in_memory": b.in_memory if b else None, "spilled": b.spilled if b else 0}

    def read_slot(self, batch: int, slot: int, max_records, poll_timeout_ms: int, query_id, spark_batch,
              connect_session=None, lent: int = 0, join: bool = True):
        """A read task's read of (batch, slot) (``lent``: one another host's read lent to this agent at the
        members' cap, that many times; its rows go back through the tracker; ``join`` False: with no session
        free the slot reads nothing, as a replay's must: a member joining moves partitions under the sessions
        that already polled, and those may not poll again; so do the batches after it while its sessions
        are in place, ``SessionPool.may_join``)."""
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
        session = None
        try:
            # The claim's answer comes on the tracker's connection behind the acknowledgements of the batch
            # before (the tracker sent them first, and they are queued on the loop as they arrive): the
            # sessions it frees are free by the time this read looks for one.
            claim, _ = self.reads.call(Claim(batch, slot, query_id, spark_batch, connect_session,
                                                carrying=self.pool.carrying_for(batch)), timeout=60)
            if claim["owner"] is None:  # acquired by an agent that is gone: no new records under this id
                return {"rows": 0, "cached": False, "lost": True}, records.to_ipc(
                    records.empty_batch(self.config["include_headers"]))
            if claim["owner"] != self.agent_id:
                # Another host acquired this (batch, slot): relay its cached rows through the tracker.
                rep, ipc = call(self.tracker, Fetch(batch, slot), timeout=120)
                return {"rows": rep.get("rows", 0), "cached": True, "relayed": True}, ipc
            granted = claim.get("max_records", max_records)
            if granted == 0:  # the batch's cap went to reads whose sessions carry records: acquire nothing
                return self._read_nothing(batch, slot, spark_batch, query_id, key)
            session, polled = self.pool.reserve(batch, max_records)
            opened = False
            if session is None and not (join and self.pool.may_join(batch)):
                return self._read_nothing(batch, slot, spark_batch, query_id, key)
            if session is None:
                # No consumer is free here: the query's members are capped, so the tracker says whether a
                # new one may join (another host may first close one it did not use in this batch).
                member, _ = call(self.tracker, Member(batch, slot, lent), timeout=60)
                if member.get("relay"):  # at the cap: an agent with a free consumer reads it for this task
                    rep, ipc = call(self.tracker, Fetch(batch, slot, max_records, poll_timeout_ms, query_id,
                                                        spark_batch, lent + 1), timeout=120)
                    return {"rows": rep.get("rows", 0), "cached": True, "relayed": True}, ipc
                if not member["open"]:  # the query has all the members it may have, all in use elsewhere
                    return self._read_nothing(batch, slot, spark_batch, query_id, key)
                session, opened = self.pool.open(batch, max_records), True
            taken, session = session, None  # from here on, the read owns it
            try:
                if polled is None:
                    polled = taken.poll(batch, slot, granted, poll_budget(taken, poll_timeout_ms), claim.get("carry_ms"),
                                        more=lambda want: self._more(batch, slot, want))
                rb, holding = polled.result()
                holding.batch, holding.slot = batch, slot
            except MemberRefused as e:
                return self._refused(taken, batch, slot, spark_batch, query_id, key, str(e))
            except BaseException:
                self.pool.give_back(taken)
                raise
            session = taken
            acquired = holding.acquired if rb.num_rows else {}
            converting = time.perf_counter()
            out, poison = records.visible(rb, self.config.get("max_delivery_count"), self.config["include_headers"])
            ipc = records.to_ipc(out)
            convert_ms = (holding.convert_s + time.perf_counter() - converting) * 1000
            # The tracker learns what this (batch, slot) holds before any row of it reaches Spark: a
            # record it does not know of could never be acknowledged nor given a verdict.
            try:
                self.reads.call(Acquired(
                    batch, slot, rows=rb.num_rows, session=session.session_id, acquired_at=holding.acquired_at,
                    offsets={t: {str(p): runs for p, runs in parts.items()} for t, parts in acquired.items()},
                    poison=poison, redelivered=records.redelivered(rb), spark_batch=spark_batch,
                    members=len(self.pool), timed_out=holding.timed_out, carried=session.carrying,
                    convert_ms=round(convert_ms, 1), answered=[[t, p] for t, p in sorted(holding.answered)],
                    opened=opened),
                    timeout=60)
            except BaseException:
                if rb.num_rows:
                    session.release_all(30).result(35)
                self.pool.give_back(session)
                raise
            entry = Cached(batch, slot, session if rb.num_rows else None, ipc, out.num_rows, rb.num_rows,
                           full=rb if self.config.get("dead_letter") else None, query_id=query_id)
            if not rb.num_rows:
                self.pool.give_back(session)
            if self._budget is not None and rb.num_rows:
                self._budget.admit(entry)
                ipc = entry.ipc
            with self._lock:
                self._cache[key] = entry
            session = None
            return {"rows": out.num_rows, "cached": False}, ipc
        finally:
            if session is not None:  # reserved and not used: free for the next read
                self.pool.give_back(session)
            with self._lock:
                ev = self._inflight.pop(key, None)
            if ev is not None:
                ev.set()

    def _more(self, batch: int, slot: int, want: int) -> int:
        """How many of the ``want`` records a poll of (batch, slot) brought beyond its grant it may hand out now
        (the batch's cap left over: ``BatchPolicy.more``); on the session's thread, bounded. 0 when the tracker
        does not answer in time: they are carried, as before (a grant it made meanwhile goes back to the
        batch when this read reports what it handed out)."""
        try:
            rep, _ = self.reads.call(More(batch, slot, want), timeout=MORE_TIMEOUT_S)
            return int(rep.get("more", 0))
        except Exception as e:  # noqa: BLE001 - the read goes on with what it was granted
            log.info("agent %s: batch %d slot %d: no answer to how many more records it may hand out (%s); "
                     "they are carried", self.agent_id, batch, slot, self._scrub(str(e)))
            return 0

    def _refused(self, session, batch: int, slot: int, spark_batch, query_id, key, why: str) -> tuple[dict, bytes]:
        """The group refused the member this read opened (group.share.max.size): it leaves, the read gets
        nothing, and the tracker learns the group's limit (it reads on with the members it has, or
        fails the query saying why)."""
        self.pool.drop(session)
        log.warning("agent %s: %s", self.agent_id, why)
        self.reads.call(Acquired(batch, slot, rows=0, spark_batch=spark_batch, members=len(self.pool),
                                    refused=why), timeout=60)
        ipc = records.to_ipc(records.empty_batch(self.config["include_headers"]))
        with self._lock:
            self._cache[key] = Cached(batch, slot, None, ipc, 0, 0, query_id=query_id)
        return {"rows": 0, "cached": False}, ipc

    def _read_nothing(self, batch: int, slot: int, spark_batch, query_id, key) -> tuple[dict, bytes]:
        """A slot granted no records: it reads nothing, and the tracker knows so (empty, not timed out)."""
        self.reads.call(Acquired(batch, slot, rows=0, spark_batch=spark_batch, members=len(self.pool)), timeout=60)
        ipc = records.to_ipc(records.empty_batch(self.config["include_headers"]))
        with self._lock:
            self._cache[key] = Cached(batch, slot, None, ipc, 0, 0, query_id=query_id)
        return {"rows": 0, "cached": False}, ipc

    # tracker commands -----------------------------------------------------------------------
    def _on_prefetch(self, conn, m: Prefetch) -> dict:
        return {"polling": self.pool.prefetch(m.batch, m.count, m.max_records, m.poll_timeout_ms, m.carry_ms)}

    def _on_fetch(self, conn, m: Fetch):
        with self._lock:
            hit = self._cache.get((m.batch, m.slot))
        if hit is None and m.poll_timeout_ms is not None:  # a read lent to this agent: it reads the slot now
            self.read_slot(m.batch, m.slot, m.max_records, m.poll_timeout_ms, m.query_id, m.spark_batch, lent=m.lent)
            with self._lock:
                hit = self._cache.get((m.batch, m.slot))
        if hit is None:
            raise BatchRefused(f"batch {m.batch} slot {m.slot} is not cached here")
        return {"rows": hit.rows}, hit.ipc

    def _on_trim(self, conn, m: Trim) -> dict:
        closed = self.pool.trim(m.not_since_batch, m.idle_s, m.at_most)
        return {"closed": closed, "members": len(self.pool)}

    def _on_shutdown(self, conn, m: Shutdown) -> dict:
        threading.Thread(target=self.shutdown, name="agent-shutdown", daemon=True).start()
        return {"ok": True}

    # lifecycle ------------------------------------------------------------------------------
    def _tracker_lost(self) -> None:
        if not self._shutting_down:
            log.warning("agent %s: tracker connection ended; releasing all records and exiting", self.agent_id)
            self.shutdown()

    def shutdown(self) -> None:
        with self._lock:  # the tracker's Shutdown and a lost tracker connection may both call it
            if self._shutting_down:
                return
            self._shutting_down = True
        closing = self.pool.close_all()  # close() releases whatever a session still holds, at once
        if self.server is not None:
            self.server.close()
        self._leave_host()
        wait_futures(closing, timeout=CLOSE_WAIT_S)
        if self._deadletters is not None:
            self._deadletters.close()
        self.tracker.close()
        self.reads.close()
        self.done.set()

    def _leave_host(self) -> None:
        """This run's files in the executor removed and the life lock let go, before the consumers finish closing
        (which waits for the broker: up to CLOSE_WAIT_S when the network is cut): a read task of the same run
        (the tracker was only cut off) starts a new agent at once instead of waiting for this one to end."""
        base = runtime.agent_base(self.tracker_id)
        for suffix in (".spawn", ".alive"):  # removed while held: a spawner that opened them retries on new ones
            runtime.remove(base + suffix)
        if self.alive_fd is not None:
            os.close(self.alive_fd)
            self.alive_fd = None


def _connect_tracker(tracker_addr, secret: str, inline=None, **kwargs) -> wire.RpcConnection:
    """The connection to the query's tracker on the driver (a cut network waited out for CONNECT_WAIT_S, in
    short attempts; a refusal fails at once), or an error a user can act on."""
    host, port = tracker_addr
    try:
        return endpoints.connect_patiently((host, port), secret, CONNECT_WAIT_S, CONNECT_ATTEMPT_S, inline=inline,
                                           **kwargs)
    except OSError as e:
        shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        raise PeerConnectionError(
            f"executor {socket.gethostname()} cannot reach the spark-share tracker on the driver at {shown} "
            f"({type(e).__name__}: {e}). Executors must reach the driver on this address and port: set "
            "spark.driver.host (or SPARK_SHARE_BIND_HOST on the driver) to an address they can reach, and the "
            "source option 'trackerPort' to a port or range your firewall opens; where executors may reach no "
            "port of the driver but Spark's own (serverless, standard access mode), use readMode=driver") from None


def main() -> None:
    params = json.loads(sys.stdin.readline())
    # Detach: the intermediate process exits, the agent is re-parented and survives the worker.
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    runtime.log_to_rotating_stderr(runtime.agent_log_path(params["tracker_id"]))
    runtime.prune_agent_files()  # what agents of ended runs on this host left (their tracker is elsewhere)
    try:
        agent = Agent(params["tracker"], params["tracker_id"], params["secret"], params["consumer_config"],
                      params["producer_config"], params["secret_values"], params.get("alive_fd"))
    except Exception as e:
        from ..options import scrub

        why = scrub(f"{type(e).__name__}: {e}", params["secret_values"])
        log.error("agent failed to start: %s", why)
        sys.stdout.write(f"ERROR {why}\n")
        sys.stdout.flush()
        os._exit(1)
    if params.get("executor_pid"):
        executor_life.when_gone(int(params["executor_pid"]), agent.executor_gone)
    # What start-up left (the imports of pyarrow, pandas, confluent-kafka) is never garbage: out of
    # the collector's sight, a full collection no longer walks it (one cost a poll 4x its CPU).
    gc.freeze()
    try:
        sys.stdout.write(f"READY {agent.agent_id}\n")
        sys.stdout.flush()
    except OSError:  # the worker that started us was killed meanwhile; we serve its retry
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    sys.stdout = open(os.devnull, "w")
    agent.done.wait()
    log.info("agent %s: exiting", agent.agent_id)
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
