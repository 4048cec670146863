"""The real tracker, driven through its real protocol on real TLS sockets by simulated agents: how the
driver side behaves with hundreds of hosts, thousands of read slots and partitions, without Spark or a
share consumer on the agents' side.

Three processes, joined by pipes (JSON lines; the tracker's address and secret travel there, never on
a socket of the harness's own):

- the harness (``run``): an embedded broker holding the topic (its partitions are what the tracker's
  watermark thread refreshes), and the relay between the other two;
- the tracker process (``tracker``): a ``ShareStreamReader`` as Spark's source runner holds it, in
  cluster mode (``SPARK_SHARE_MASTER`` set: no polls ahead, an agent joins with one consumer), called as
  Spark calls it: ``latestOffset`` (it acknowledges the batch before and plans the next), then
  ``partitions``; it reports per batch what the tracker cost (CPU, threads, memory, bytes it sent, the
  time of those two calls, of the acknowledgements' answers) and its status;
- the agents' process (``agents``): N agents, each one TLS connection to the tracker (``endpoints.connect``)
  answering the tracker's requests as an agent does (Ack, AckResult, Trim, Ping...); for each batch it
  places the slots on agents (``placement``: ``sticky``, as a cluster whose tasks keep landing where they
  landed, or ``random``, as Spark's shuffled offers), and each slot claims (``Claim``, opening a member
  only when the tracker grants one) and reports what it "acquired" (``Acquired``: a run of offsets of
  partitions of the slot's own), and, with ``rejects``, reject()s rows as the user's process does. With
  ``hold_s``, a burst: every read of a batch starts at once while the tracker process is stopped (SIGSTOP)
  for that long, so each agent's first claim waits in the tracker's sockets with every other's, as the
  claims of a cluster's task slots that start together would; the rest of each agent's claims follow
  bundled (``Bundler``), as a host's would.

It checks what must hold at any size: every batch acknowledged, the group's members never above the
cap (the agents' process counts every consumer it opens and closes), no request failed.

    python tests/harness/scale_sim.py --agents 10 --slots 8 --partitions 1000 --batches 20
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [p for p in (ROOT, os.path.dirname(HERE)) if p not in sys.path]

TOPIC = "scale"
GROUP = "scale-sim"
RECORDS_PER_SLOT = 100  # what each simulated read "acquires" (--rows-per-slot)


# --- the tracker's process ---------------------------------------------------------------------------
def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _pool_threads() -> int:
    """The tracker server's handler threads (started as handlers wait, never past ``endpoints.SERVER_WORKERS``)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith("tracker-h"))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def tracker_main(args) -> None:
    """Reads commands on stdin, one JSON per line: {"batch": n} runs Spark's calls for batch n (n-1 is
    committed), {"verdicts": ...} is the user's reject() of a batch, {"stop": true} stops. Writes one JSON
    per line: the address, then each batch's slots and costs."""
    os.environ["SPARK_SHARE_MASTER"] = "spark://scale-sim:7077"  # a cluster: no polls ahead
    os.environ["SPARK_SHARE_BIND_HOST"] = "127.0.0.1"
    from spark_share.offsets import INITIAL, offset_of
    from spark_share.options import parse_options
    from spark_share.reader import ShareStreamReader
    from spark_share.spark_versions import ReadAllAvailable

    reader = ShareStreamReader(parse_options({
        "kafka.bootstrap.servers": args.bootstrap, "kafka.group.id": GROUP, "subscribe": TOPIC,
        "numPartitions": str(args.agents * args.slots), "ackTimeoutMs": "10000", "idleProbeIntervalMs": "100",
        "readMode": "executors"}))  # the simulated agents are the executors' agents
    start = offset_of(INITIAL)
    t = reader._t()
    import logging

    logging.getLogger("spark_share").setLevel(logging.WARNING)  # an INFO line per batch would be much of its work
    out = sys.stdout

    def say(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    say({"address": list(t.address), "secret": t.secret, "tracker_id": t.tracker_id, "pid": os.getpid()})
    served = _time_served()
    server = t.server
    sent = lambda: sum(c.bytes_sent for c in list(server.connections))  # noqa: E731
    cpu_was, bytes_was = time.process_time(), sent()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("stop"):
            break
        if "verdicts" in cmd:
            from spark_share.transport.protocol import Verdicts

            t0 = time.perf_counter()
            rep = t.ledger.record_verdicts(Verdicts(cmd["spark_batch"], "reject", cmd["verdicts"], "sim"))
            say({"verdicts": rep, "ms": round((time.perf_counter() - t0) * 1000, 1)})
            continue
        t0 = time.perf_counter()
        end = reader.latestOffset(start, ReadAllAvailable())
        t1 = time.perf_counter()
        parts = reader.partitions(start, end) if end != start else []
        t2 = time.perf_counter()
        if end != start:
            start = end
        # Since the last command: the batch before's reads (claims, acquired), its acknowledgement
        # and this batch's planning.
        cpu_now, bytes_now = time.process_time(), sent()
        say({"batch": cmd["batch"], "slots": [[p.batch, p.slot, p.max_records] for p in parts],
             "latestOffsetMs": round((t1 - t0) * 1000, 2), "partitionsMs": round((t2 - t1) * 1000, 2),
             "cpuMs": round((cpu_now - cpu_was) * 1000, 1), "threads": _threads(), "poolThreads": _pool_threads(),
             "rssMb": round(_rss_mb(), 1), "pyBlocks": sys.getallocatedblocks(), "bytesSent": bytes_now - bytes_was,
             "members": t.members.total, "memberLimit": t.members.cap,
             "acked": _last_acked(t), **served.pop_medians()})
        cpu_was, bytes_was = cpu_now, bytes_now
    final = t.status()
    reader.stop()
    say({"final": {k: final[k] for k in ("acquired", "accepted", "rejected", "failed", "members", "agents")}})


class _Served:
    """How long the tracker took to answer each Claim and Acquired: from the simulated agent's send (its
    ``sentAt``, on the clock every process of this machine shares) to the tracker's reply, queueing in
    the tracker included; what the agents' own process adds to the round trip is not."""

    def __init__(self):
        self.lock = threading.Lock()
        self.times: dict[str, list[float]] = {"claim": [], "acquired": []}

    def add(self, op: str, ms: float) -> None:
        with self.lock:
            self.times[op].append(ms)

    def pop_medians(self) -> dict:
        with self.lock:
            times, self.times = self.times, {"claim": [], "acquired": []}
        return {**{f"{op}ServedP50Ms": round(statistics.median(v), 2) if v else 0.0 for op, v in times.items()},
                **{f"{op}ServedMaxMs": round(max(v), 2) if v else 0.0 for op, v in times.items()}}


def _time_served() -> _Served:
    from spark_share.transport import wire

    served = _Served()
    handle = wire.RpcConnection._handle

    def timed(conn, rid, header, blob, inline=False):
        requests = header.get("requests", []) if header.get("op") == "bundle" else [header]
        handle(conn, rid, header, blob, inline)
        now = time.monotonic()
        for r in requests:
            if isinstance(r, dict) and r.get("sentAt") is not None:
                served.add(r["op"], (now - r["sentAt"]) * 1000)

    wire.RpcConnection._handle = timed  # type: ignore[method-assign]
    return served


def _last_acked(t) -> dict | None:
    with t.ledger.lock:
        done = [b for b in t.batches.values() if b.state in ("acked", "released") and b.committed_at and b.acked_at]
        b = max(done, key=lambda b: b.batch, default=None)
        return None if b is None else {"batch": b.batch, "ackMs": round((b.acked_at - b.committed_at) * 1000, 1),
                                       "rows": b.rows, "accepted": b.outcome.accepted, "failed": b.outcome.failed}


# --- the agents' process -----------------------------------------------------------------------------
class Members:
    """Every consumer the simulated agents hold, counted across them: the cap must hold at any time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.closed = 0  # consumers the tracker asked agents to close (idle)
        self.relayed = 0  # reads lent to another agent at the cap (its consumer polled, the rows relayed)

    def change(self, n: int) -> None:
        with self.lock:
            self.now += n
            self.most = max(self.most, self.now)


class Hold:
    """A burst's start: the tracker stopped until ``until`` (``time.monotonic()``, the clock every process
    of this machine shares), and longer if not every reading agent has sent its first claim by then (a
    busy machine starts the reads' threads late). What an agent sends while it is stopped is stamped as
    sent at ``until`` (or later, when sent later): the tracker times its answer from the stamp, so its
    figures are its queueing and work from the moment it resumes."""

    def __init__(self):
        self.lock = threading.Condition()
        self.until = 0.0
        self.stopped = False
        self.queued = 0  # messages sent while the tracker was stopped

    def begin(self, until: float) -> None:
        with self.lock:
            self.until, self.queued, self.stopped = until, 0, True

    def wait_queued(self, n: int, timeout: float) -> None:
        """Until ``until`` has passed and ``n`` messages wait (bounded by ``timeout`` beyond ``until``)."""
        threading.Event().wait(max(0.0, self.until - time.monotonic()))  # the burst's length, as asked
        with self.lock:
            self.lock.wait_for(lambda: self.queued >= n, timeout)

    def end(self) -> None:
        with self.lock:
            self.stopped = False

    def stamp(self, now: float) -> float:
        with self.lock:
            if self.stopped:
                self.queued += 1
                self.lock.notify_all()
                return max(self.until, now)
        return now


class SimAgent:
    """An agent as the tracker sees it: a connection, consumers (counted, not real), answers."""

    def __init__(self, index: int, address, secret: str, members: Members, partitions: int, rows: int, query: str,
                 hold: Hold):
        from spark_share.transport import endpoints
        from spark_share.transport.bundler import Bundler
        from spark_share.transport.protocol import TRACKER_TO_AGENT, Hello, call, dispatcher

        self.agent_id = f"sim-host-{index}:{1000 + index}"
        self.query = query  # the tracker registers under it: each run its own, so two runs may share a machine
        self.host = f"sim-host-{index}"
        self.members = members
        self.partitions = partitions
        self.rows = rows
        self.verdicts_received = 0  # verdicts the tracker sent this agent (it must hold every one)
        self.staged: dict[int, list] = {}
        self.lock = threading.Lock()
        self.sessions: dict[str, int] = {}  # session id -> last batch it polled
        self.held: dict[int, dict[int, tuple[str, int]]] = {}  # batch -> slot -> (session, rows)
        self._acked: dict[int, dict] = {}
        self.seq = 0
        self.conn = endpoints.connect(tuple(address), secret, handler=dispatcher(self, TRACKER_TO_AGENT),
                                 name="sim-agent", workers=2, inline=lambda h: h.get("op") in ("stage", "ack"))
        hello, _ = call(self.conn, Hello(self.agent_id, self.host, 1000 + index), timeout=60)
        self.conn.set_keepalive(float(hello["dead_after_s"]))
        send = self.conn.call_async

        def stamped(header: dict, *blob):
            """Claims and Acquireds stamped as they leave, alone or bundled: the tracker's process times
            its answer from the stamp (what a read waits for in a bundle is in the round trip)."""
            now = hold.stamp(time.monotonic())
            for r in header.get("requests", []) if header.get("op") == "bundle" else [header]:
                if r.get("op") in ("claim", "acquired"):
                    r["sentAt"] = now
            return send(header, *blob)
        self.conn.call_async = stamped  # type: ignore[method-assign]
        self.reads = Bundler(self.conn)  # as an agent sends its reads' Claims and Acquireds
        for _ in range(int(hello["slots"])):
            self._open(-1)

    def _open(self, batch: int) -> str:
        self.seq += 1
        sid = f"{self.agent_id}-{self.seq}"
        self.sessions[sid] = batch
        self.members.change(+1)
        return sid

    def read(self, batch: int, slot: int, lent: int = 0) -> tuple[float, float]:
        """One read task of (batch, slot) on this host (``lent``: another host's, lent to this one at the
        members' cap): (claim RTT, acquired RTT) in ms."""
        from spark_share.transport.protocol import Acquired, Claim, Fetch, Member, call

        t0 = time.perf_counter()
        claim, _ = self.reads.call(Claim(batch, slot, self.query, batch), timeout=120)
        t1 = time.perf_counter()
        if claim["owner"] != self.agent_id:
            raise AssertionError(f"batch {batch} slot {slot}: owner {claim['owner']}")
        with self.lock:
            free = [s for s, last in self.sessions.items() if last < batch]
            session = free[0] if free else None
            if session is not None:
                self.sessions[session] = batch
        opened = session is None
        if session is None:
            member, _ = call(self.conn, Member(batch, slot, lent), timeout=120)
            if member.get("relay"):
                call(self.conn, Fetch(batch, slot, None, 1000, self.query, batch, lent + 1), timeout=120)
                with self.members.lock:
                    self.members.relayed += 1
                return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000
            if not member["open"]:
                self.reads.call(Acquired(batch, slot, rows=0), timeout=120)
                return (t1 - t0) * 1000, 0.0
            with self.lock:
                session = self._open(batch)
        rows = self.rows
        p = slot % self.partitions
        first = batch * rows
        offsets = {TOPIC: {str(p): [[first, first + rows - 1]]}}
        t2 = time.perf_counter()
        self.reads.call(Acquired(batch, slot, rows=rows, session=session, acquired_at=time.time(), offsets=offsets,
                                 spark_batch=batch, opened=opened), timeout=120)
        t3 = time.perf_counter()
        with self.lock:
            self.held.setdefault(batch, {})[slot] = (session, rows)
        return (t1 - t0) * 1000, (t3 - t2) * 1000

    # --- what the tracker asks ------------------------------------------------------------------------
    def _on_stage(self, conn, m, blob) -> dict:
        with self.lock:
            self.staged.setdefault(m.batch, []).append(blob)
        return {"staged": True}

    def _on_ack(self, conn, m) -> dict:
        from spark_share.verdict_set import VerdictSet

        with self.lock:
            held = self.held.pop(m.batch, {})
            chunks = self.staged.pop(m.batch, [])
        rejected = 0
        if chunks:
            verdicts = VerdictSet.from_chunks(chunks)
            mine = {(TOPIC, s % self.partitions) for s in held}
            assert set(verdicts.parts) <= mine, "a verdict on a record this agent does not hold"
            rejected = len(verdicts)
            self.verdicts_received += rejected
        with self.lock:
            self._acked[m.batch] = (sum(rows for _, rows in held.values()), rejected)
        return {"queued": len(held)}

    def _on_ack_result(self, conn, m) -> dict:
        with self.lock:
            rows, rejected = self._acked.pop(m.batch, (0, 0))
        return {"slots": {"all": {"accepted": rows - rejected, "rejected": rejected}}}

    def _on_trim(self, conn, m) -> dict:
        with self.lock:
            idle = [s for s, last in self.sessions.items() if last < m.not_since_batch]
            idle = idle[: m.at_most] if m.at_most is not None else idle
            for s in idle:
                del self.sessions[s]
            self.members.change(-len(idle))
            with self.members.lock:
                self.members.closed += len(idle)
            return {"closed": len(idle), "members": len(self.sessions)}

    def _on_prefetch(self, conn, m) -> dict:
        return {"polling": 0}

    def _on_dead_letter(self, conn, m) -> dict:
        return {"written": 0}

    def _on_fetch(self, conn, m):
        if m.poll_timeout_ms is not None:  # a read lent to this agent
            self.read(m.batch, m.slot, lent=m.lent)
        return {"rows": 0}, b""

    def _on_shutdown(self, conn, m) -> dict:
        return {"ok": True}

    def _on_ping(self, conn, m) -> dict:
        return {"agent_id": self.agent_id}


def agents_main(args) -> None:
    """Reads the tracker's address on stdin, then batches ({"batch": n, "slots": [...]}): each batch's
    reads, placed on the agents; writes each batch's claim and acquired RTTs."""
    first = json.loads(sys.stdin.readline())
    members, hold = Members(), Hold()
    with ThreadPoolExecutor(max_workers=16) as boot:
        agents = list(boot.map(lambda i: SimAgent(i, first["address"], first["secret"], members, args.partitions,
                                                  args.rows_per_slot, first["tracker_id"], hold), range(args.agents)))
    rng = random.Random(args.seed)
    workers = ThreadPoolExecutor(max_workers=args.concurrency)
    print(json.dumps({"ready": len(agents), "members": members.now}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("stop"):
            break
        slots = cmd["slots"]
        if args.placement == "random":
            placed = [rng.randrange(len(agents)) for _ in slots]
        else:  # sticky: slot i always on agent i // slots-per-agent
            placed = [i * len(agents) // max(1, len(slots)) for i in range(len(slots))]
        reading = len(set(placed))
        if args.hold_s:
            hold.begin(time.monotonic() + args.hold_s)
            os.kill(first["pid"], signal.SIGSTOP)
        try:
            futs = [workers.submit(agents[a].read, b, s) for (b, s, _), a in zip(slots, placed)]
            if args.hold_s:  # the burst: at least hold_s, and every reading agent's first claim in it
                hold.wait_queued(reading, timeout=30)
        finally:
            if args.hold_s:
                hold.end()
                os.kill(first["pid"], signal.SIGCONT)
        queued = hold.queued
        wait_futures(futs, timeout=600)
        errors = [f"{type(f.exception()).__name__}: {f.exception()}" for f in futs if f.exception() is not None]
        rtts = [f.result() for f in futs if f.exception() is None]
        print(json.dumps({"batch": cmd["batch"], "claimMs": [round(c, 2) for c, _ in rtts],
                          "acquiredMs": [round(a, 2) for _, a in rtts], "errors": errors[:5],
                          "members": members.now, "mostMembers": members.most,
                          "verdictsReceived": sum(a.verdicts_received for a in agents),
                          "closed": members.closed, "relayed": members.relayed,
                          "agentsReading": reading, "queuedInBurst": queued if args.hold_s else None}), flush=True)
    for a in agents:
        a.conn.close()
        a.reads.close()


# --- the harness ------------------------------------------------------------------------------------
@dataclass
class SimResult:
    batches: list[dict]  # per batch: the tracker's report joined with the agents'
    final: dict
    most_members: int
    member_limit: int
    rejects: dict | None = None  # the reject() of the second batch, when asked for


def reject_rows(hello: dict, batch: int, slots: list, partitions: int, rows_per_slot: int, n: int) -> dict:
    """reject() of ``n`` rows of ``batch`` (the first rows of its slots, as the agents acquired them), sent
    as the user's process sends it: chunks over a TLS connection to the tracker."""
    import uuid

    import numpy as np
    import pyarrow as pa

    from spark_share.acknowledgement import REJECT
    from spark_share.transport import endpoints
    from spark_share.transport.protocol import Verdicts, call
    from spark_share.verdict_set import VerdictSet

    per = min(rows_per_slot, -(-n // len(slots)))
    parts = np.repeat(np.array([s % partitions for _, s, _ in slots], np.int32), per)
    offsets = np.tile(np.arange(per, dtype=np.int64), len(slots)) + batch * rows_per_slot
    table = pa.table({"topic": pa.array(np.full(len(parts), TOPIC, object), pa.string()), "partition": parts,
                      "offset": offsets}).slice(0, n)
    t0 = time.perf_counter()
    chunks = VerdictSet.of(table, REJECT, "simulated poison").chunks()
    conn = endpoints.connect(tuple(hello["address"]), hello["secret"], name="sim-user")
    try:
        t1 = time.perf_counter()
        msg = Verdicts(batch, "reject", uuid.uuid4().hex, parts=len(chunks), reason="simulated poison")
        for part, chunk in enumerate(chunks):
            msg.part = part
            rep, _ = call(conn, msg, timeout=600, blob=chunk)
        t2 = time.perf_counter()
    finally:
        conn.close()
    assert rep.get("records") == n, rep
    return {"rows": n, "chunks": len(chunks), "bytes": sum(c.size for c in chunks),
            "encodeMs": round((t1 - t0) * 1000, 1), "trackerMs": round((t2 - t1) * 1000, 1)}


def _child(mode: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, *argv], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.dirname(HERE)])))


def _line(p: subprocess.Popen, timeout: float) -> dict:
    got: list = []
    t = threading.Thread(target=lambda: got.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    if not got or not got[0]:
        raise AssertionError(f"no answer from the {p.args[2]} process within {timeout:.0f} s (exit {p.poll()})")
    return json.loads(got[0])


def _send(p: subprocess.Popen, msg: dict) -> None:
    p.stdin.write(json.dumps(msg) + "\n")  # type: ignore[union-attr]
    p.stdin.flush()  # type: ignore[union-attr]


def run(agents: int, slots: int, partitions: int, batches: int, placement: str = "sticky", seed: int = 1,
        concurrency: int = 64, progress=None, rows_per_slot: int = RECORDS_PER_SLOT, rejects: int = 0,
        hold_s: float = 0.0) -> SimResult:
    """One simulation; the embedded broker lives in this process. ``hold_s``: each batch a burst (module
    docstring), the tracker stopped that long (shorter than the keepalive: 5 s at least)."""
    from spark_share.embedded import EmbeddedKafka

    with EmbeddedKafka() as kafka:
        kafka.create_topic(TOPIC, partitions)
        tracker = _child("tracker", ["--bootstrap", kafka.bootstrap_servers, "--agents", str(agents),
                                     "--slots", str(slots)])
        sims = None
        try:
            hello = _line(tracker, 120)
            sims = _child("agents", ["--agents", str(agents), "--partitions", str(partitions), "--placement", placement,
                                     "--seed", str(seed), "--concurrency", str(concurrency),
                                     "--rows-per-slot", str(rows_per_slot), "--hold-s", str(hold_s)])
            _send(sims, hello)
            ready = _line(sims, 600)
            assert ready["ready"] == agents, ready
            out = []
            rejected = None
            for n in range(batches + 1):  # one more: it acknowledges the last
                _send(tracker, {"batch": n})
                planned = _line(tracker, 600)
                if not planned["slots"]:
                    raise AssertionError(f"batch {n} was not planned: {planned}")
                _send(sims, {"batch": n, "slots": planned["slots"]})
                read = _line(sims, 600)
                if read["errors"]:
                    raise AssertionError(f"batch {n}: {read['errors']}")
                row = {**planned, **{k: read[k] for k in ("members", "mostMembers", "verdictsReceived", "closed",
                                                          "relayed", "agentsReading", "queuedInBurst")},
                       "claimP50Ms": statistics.median(read["claimMs"]), "claimMaxMs": max(read["claimMs"]),
                       "acquiredP50Ms": statistics.median(read["acquiredMs"]), "acquiredMaxMs": max(read["acquiredMs"])}
                if rejects and n == 1:  # the second batch: its foreachBatch rejects rows
                    rejected = reject_rows(hello, 1, planned["slots"], partitions, rows_per_slot, rejects)
                    rejected["trackerRssBeforeMb"] = row["rssMb"]
                if rejected is not None and n == 3:  # batch 1 was acknowledged by batch 2's planning
                    rejected.update(trackerRssAfterMb=row["rssMb"], received=read["verdictsReceived"])
                row.pop("slots")
                out.append(row)
                if progress is not None:
                    progress(row)
            _send(tracker, {"stop": True})
            final = _line(tracker, 120)["final"]
        finally:
            for p in (sims, tracker):
                if p is None:
                    continue
                try:
                    _send(p, {"stop": True})
                except OSError:
                    pass
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
    return SimResult(out[1:], final, max(b["mostMembers"] for b in out), out[-1]["memberLimit"], rejected)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "tracker", "agents"])
    ap.add_argument("--bootstrap")
    ap.add_argument("--agents", type=int, default=10)
    ap.add_argument("--slots", type=int, default=8, help="read slots per agent and batch")
    ap.add_argument("--partitions", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--placement", choices=["sticky", "random"], default="sticky")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=64, help="read tasks under way at once (Spark's task slots)")
    ap.add_argument("--rows-per-slot", type=int, default=RECORDS_PER_SLOT)
    ap.add_argument("--rejects", type=int, default=0, help="reject() this many rows of the second batch")
    ap.add_argument("--hold-s", type=float, default=0.0, help="each batch a burst: the tracker stopped this long")
    args = ap.parse_args(argv)
    if args.mode == "tracker":
        tracker_main(args)
    elif args.mode == "agents":
        agents_main(args)
    else:
        r = run(args.agents, args.slots, args.partitions, args.batches, args.placement, args.seed, args.concurrency,
                progress=lambda row: print(json.dumps(row), flush=True), rows_per_slot=args.rows_per_slot,
                rejects=args.rejects, hold_s=args.hold_s)
        print(json.dumps({"final": r.final, "mostMembers": r.most_members, "memberLimit": r.member_limit,
                          "rejects": r.rejects}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
