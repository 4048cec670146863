"""Chaos run: a continuous kafka-share query under random, overlapping faults; then the no-loss
check and the resource verdict.

    .venv/bin/python tests/harness/chaos.py --minutes 3 --seed 1 --out chaos-out
    .venv/bin/python tests/harness/chaos.py --minutes 60 --seed 7 --out chaos-60 --sample-every 10   # the soak

Two processes. This one is Kafka and the operator: it runs the embedded broker, produces at a
steady rate, reads the dead-letter topic, draws the faults from ``--seed`` and injects them, samples
resources, and judges the run at the end. The query process (``chaos.py query``, started here) is
the user's Spark application: a continuous query whose foreachBatch rejects poison records,
releases some records once, writes the rest to a sink file, and restarts from its checkpoint
whenever the query fails. Commands travel to it as JSON lines on its stdin.

The faults, at exponential random times, free to overlap: a Python worker, an agent or the source
runner SIGKILLed; the query stopped and restarted; foreachBatch raising after its write; the broker
down and up; ShareFetch and ShareAcknowledge errors; a batch that outlives the record lock.

``--kafka-start SCRIPT`` runs the same on a real Kafka >= 4.2 broker started from SCRIPT
(tests/harness/kafka_dist/start.sh with KAFKA_HOME set; tests/harness/kafka_kit.py) instead of the embedded one. Its
broker faults are a clean restart (``broker_restart``) and a SIGKILL then a start on the same data
directory (``broker_kill``); error injection (``fetch_errors``, ``ack_errors``) and ``broker_down``
exist only on the embedded broker.

Exit 0 when: produced = written + rejected (nothing lost), every duplicate follows a fault, every
query failure follows a fault, the share group is empty at the end, and no resource series of the
query process and what it started keeps growing after warm-up. report.json, resources.json and
resources.png land in --out. The seed fixes the fault schedule; rerun with it to replay.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # harness: the real broker of --kafka-start, the resource sampler

TOPIC, DLQ = "chaos", "chaos-dlq"
KILLS = {"kill_worker": "python workers", "kill_agent": "agent", "kill_runner": "runner"}  # fault -> process kind
COMMANDS = {"restart_query": "restart", "raise_in_batch": "raise", "slow_batch": "slow"}  # fault -> query command
FAULTS = ("kill_worker", "kill_agent", "kill_runner", "restart_query", "raise_in_batch", "broker_down",
          "fetch_errors", "ack_errors", "slow_batch")
REAL_FAULTS = ("kill_worker", "kill_agent", "kill_runner", "restart_query", "raise_in_batch", "broker_restart",
               "broker_kill", "slow_batch")  # on a real broker (--kafka-start)
# How long after it starts a fault can still make a batch's records come back, beyond its own
# duration: a killed agent's locks expire, an injected error waits for the next request.
EFFECT_S = 15.0
# Records a batch writes were acquired at most this long before its foreachBatch began.
ACQUIRED_BEFORE_S = 15.0
FAILURE_AFTER_FAULT_S = 120.0  # a query failure must follow a fault within this long
POISON_EVERY, RETRY_EVERY = 50, 33  # record kinds by id: malformed (rejected), released once


# --- the fault schedule ------------------------------------------------------------------------------
@dataclass
class Fault:
    at: float  # seconds after the start
    kind: str
    duration: float = 0.0  # broker_down: how long the broker stays down
    errors: list[int] = field(default_factory=list)  # fetch_errors / ack_errors: codes injected
    started: float | None = None  # wall clock when injected
    ended: float | None = None
    outcome: str = ""


def schedule(seed: int, seconds: float, mean_gap: float, kinds=FAULTS) -> list[Fault]:
    """The faults of a run, drawn from ``seed`` alone: same seed, same schedule. Kinds come in
    shuffled rounds, so a run with as many faults as kinds has each; times are exponential, so
    faults overlap."""
    rnd = random.Random(seed)
    out, t = [], rnd.expovariate(1 / mean_gap)
    deck: list[str] = []
    while t < seconds:
        if not deck:
            deck = rnd.sample(list(kinds), len(kinds))
        kind = deck.pop()
        f = Fault(round(t, 2), kind)
        if kind == "broker_down":
            f.duration = round(rnd.uniform(2, 8), 1)
        elif kind == "fetch_errors":
            # NOT_LEADER_OR_FOLLOWER, REQUEST_TIMED_OUT (retriable) or TOPIC_AUTHORIZATION_FAILED (fatal)
            f.errors = rnd.choice([[6, 6, 7], [7, 7], [29]])
        elif kind == "ack_errors":
            f.errors = rnd.choice([[29], [7], [29, 29]])
        out.append(f)
        t += rnd.expovariate(1 / mean_gap)
    return out


# --- the operator side --------------------------------------------------------------------------------
class Produced:
    """Records produced at a steady rate with unique ids (key = id), counted once the broker has them."""

    def __init__(self, bootstrap: str, rate: float, partitions: int):
        from confluent_kafka import Producer

        # Batched sends (linger 500 ms): the embedded broker's share fetch scans a partition's whole
        # log message set by message set, and it keeps 100k sets per partition. One record per set
        # (linger 5 ms at this rate) made a 60-minute run's fetches take seconds by the end (8,000
        # new records: 5.6 s behind 80k one-record sets, 0.36 s behind 100-record sets), and a
        # broker that slow ends share sessions through its clients' timeouts.
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 500,
                                  "message.timeout.ms": 600000, "log_level": 2})
        self.rate, self.partitions = rate, partitions
        self.ids: set[int] = set()
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)

    @staticmethod
    def value(i: int) -> bytes:
        if i % POISON_EVERY == 7:
            return b"\xff not json " + str(i).encode()
        kind = "retry" if i % RETRY_EVERY == 5 else "order"
        return json.dumps({"id": i, "kind": kind, "amount": i % 997}).encode()

    def _on_delivery(self, err, msg):
        with self._lock:
            if err is None:
                self.ids.add(int(msg.key()))
            else:
                self.failed.append(str(err))

    def _run(self):
        t0, i = time.monotonic(), 0
        while not self._stop.is_set():
            due = t0 + i / self.rate
            if due > time.monotonic():
                self._stop.wait(due - time.monotonic())
                continue
            while True:
                try:
                    self.producer.produce(TOPIC, key=str(i).encode(), value=self.value(i),
                                          partition=i % self.partitions, on_delivery=self._on_delivery)
                    break
                except BufferError:
                    self.producer.poll(0.1)
            self.producer.poll(0)
            i += 1

    def start(self):
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        left = self.producer.flush(120)
        return left


class DeadLetters:
    """Reads the dead-letter topic as it fills: (id, when written) of every rejected record, once per
    record of the topic (keyed by partition and offset: a reader that rejoins its group after a broker
    restart reads from the start again, and a record read twice is not a second dead letter)."""

    def __init__(self, bootstrap: str, group: str):
        from confluent_kafka import Consumer

        self.bootstrap = bootstrap
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                                  "enable.auto.commit": False, "log_level": 2})
        self.consumer.subscribe([DLQ])
        self._records: dict[tuple[int, int], tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dead-letters", daemon=True)
        self._thread.start()

    def _keep(self, m) -> None:
        with self._lock:
            self._records[(m.partition(), m.offset())] = (int(m.key()), m.timestamp()[1] / 1000)

    def _run(self):
        while not self._stop.is_set():
            for m in self.consumer.consume(500, 0.5):
                if m.error() is None:
                    self._keep(m)

    @property
    def records(self) -> list[tuple[int, float]]:
        with self._lock:
            return list(self._records.values())

    def ids(self) -> list[int]:
        return [i for i, _ in self.records]

    def read_to_end(self, timeout_s: float = 60.0) -> None:
        """Read every partition of the topic from its first offset to its high watermark, without a
        group: what the topic holds, whatever the live reader's group went through."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "chaos-dlq-final", "enable.auto.commit": False,
                      "log_level": 2})
        try:
            meta = c.list_topics(DLQ, timeout=10)
            parts = sorted(meta.topics[DLQ].partitions)
            ends = {p: c.get_watermark_offsets(TopicPartition(DLQ, p), timeout=10)[1] for p in parts}
            c.assign([TopicPartition(DLQ, p, OFFSET_BEGINNING) for p in parts])
            pos = {p: -1 for p in parts}
            deadline = time.time() + timeout_s
            while any(pos[p] + 1 < ends[p] for p in parts) and time.time() < deadline:
                for m in c.consume(500, 0.5):
                    if m.error() is None:
                        self._keep(m)
                        pos[m.partition()] = max(pos[m.partition()], m.offset())
            short = {p: (pos[p] + 1, ends[p]) for p in parts if pos[p] + 1 < ends[p]}
            if short:
                print(f"chaos: the dead-letter topic was not read to its end within {timeout_s:.0f} s: {short}",
                      flush=True)
        finally:
            c.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.consumer.close()


def read_sink(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    except FileNotFoundError:
        pass
    return out


class Operator:
    """Injects the faults of the schedule into the query process's world, on its own thread."""

    def __init__(self, kafka, query: subprocess.Popen, runtime: str, faults: list[Fault], seed: int, t0: float):
        self.kafka, self.query, self.runtime, self.faults, self.t0 = kafka, query, runtime, faults, t0
        self.rnd = random.Random(seed + 1)  # which process to kill; apart from the schedule's own draws
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._down = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()
        for t in self._timers:
            t.cancel()
        if self._down.locked():
            self._up(None)

    def _run(self):
        for f in self.faults:
            if self._stop.wait(max(0.0, self.t0 + f.at - time.time())):
                return
            f.started = time.time()
            try:
                f.outcome = self._inject(f)
            except Exception as e:  # a fault that cannot be injected is recorded, not fatal
                f.outcome = f"not injected: {type(e).__name__}: {e}"
            if f.ended is None and f.kind != "broker_down":
                f.ended = f.started
            print(f"chaos {f.started - self.t0:7.1f}s {f.kind:<15} {f.outcome}", flush=True)

    def _inject(self, f: Fault) -> str:
        if f.kind in KILLS:
            return self._kill_one(KILLS[f.kind])
        if f.kind in COMMANDS:
            return self._command(COMMANDS[f.kind])
        return getattr(self, "_" + f.kind)(f)

    # process faults ------------------------------------------------------------------------
    def _procs(self, kind: str):
        from harness.resources import run_processes

        return sorted((p for k, p in run_processes(self.query.pid, self.runtime).values() if k == kind),
                      key=lambda p: p.pid)

    def _kill_one(self, kind: str) -> str:
        import psutil

        procs = self._procs(kind)
        if kind == "python workers":  # the daemon forks the workers; killing it is not this fault
            procs = [p for p in procs if "pyspark.daemon" in " ".join(getattr(p.parent(), "cmdline", list)())]
        if not procs:
            return f"no {kind} process to kill"
        p = self.rnd.choice(procs)
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            return f"{kind} {p.pid} exited first"
        try:
            p.wait(15)
        except psutil.Error:
            pass
        return f"killed {kind} pid {p.pid} (of {len(procs)})"

    # query faults (the query process acts on them) -------------------------------------------
    def _command(self, what: str) -> str:
        assert self.query.stdin is not None
        self.query.stdin.write((json.dumps({"command": what}) + "\n").encode())
        self.query.stdin.flush()
        return f"asked the query process to {what}"

    # broker faults ------------------------------------------------------------------------
    def _broker_restart(self, f):
        return self._real_broker_fault(f, kill=False)

    def _broker_kill(self, f):
        return self._real_broker_fault(f, kill=True)

    def _real_broker_fault(self, f, kill: bool) -> str:
        """A clean stop, or SIGKILL, of the real broker, then a start on the same data directory; the
        fault lasts until the broker answers again."""
        if not self._down.acquire(blocking=False):
            f.ended = f.started
            return "the broker is already down"
        try:
            node = self.kafka.nodes[0]
            node.kill() if kill else node.stop()
            node.start()
        finally:
            f.ended = time.time()
            self._down.release()
        return f"broker {'killed (SIGKILL)' if kill else 'stopped'} and back after {f.ended - f.started:.1f} s"

    def _broker_down(self, f):
        if not self._down.acquire(blocking=False):
            f.ended = f.started
            return "the broker is already down"
        self.kafka.broker_down(1)
        t = threading.Timer(f.duration, self._up, args=(f,))
        self._timers.append(t)
        t.start()
        return f"broker down for {f.duration} s"

    def _up(self, f):
        self.kafka.broker_up(1)
        if f is not None:
            f.ended = time.time()
        self._down.release()

    def _fetch_errors(self, f):
        self.kafka.push_request_errors("ShareFetch", f.errors)
        return f"next ShareFetch requests fail with {f.errors}"

    def _ack_errors(self, f):
        self.kafka.push_request_errors("ShareAcknowledge", f.errors)
        return f"next ShareAcknowledge requests fail with {f.errors}"


# --- the verdict ------------------------------------------------------------------------------------
def explain_duplicates(deliveries: dict[int, list[tuple[float, float, str]]], faults: list[Fault],
                       lock_s: float) -> tuple[Counter, list[int]]:
    """For every id delivered more than once: the kinds of the faults that can have caused it.

    deliveries: id -> [(start, end, where)] in time order (a sink batch's foreachBatch, or a
    dead letter's write time for both). A fault explains a repeat when it began before the
    repeat and was still having effect (its duration, a lock, ``EFFECT_S``) when the previous
    delivery's records may already have been acquired. Returns (fault combination -> count,
    unexplained ids)."""
    windows = [(f.started, (f.ended or f.started) + lock_s + EFFECT_S, f.kind) for f in faults
               if f.started is not None and not f.outcome.startswith(("no ", "not injected", "the broker is"))]
    combos: Counter = Counter()
    unexplained = []
    for rid, ds in deliveries.items():
        for (s1, _e1, _w1), (s2, _e2, _w2) in zip(ds, ds[1:]):
            kinds = sorted({k for fs, fe, k in windows if fs <= s2 and fe >= s1 - ACQUIRED_BEFORE_S})
            if kinds:
                combos[" + ".join(kinds)] += 1
            else:
                unexplained.append(rid)
    return combos, unexplained


def group_left(bootstrap: str, group: str, seconds: float = 12.0) -> int:
    """Records the share group still hands out (after the query stopped): must be none. Any it
    gets are RELEASEd again."""
    from confluent_kafka import AcknowledgeType, ShareConsumer

    c = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": group, "share.acknowledgement.mode": "explicit"})
    c.subscribe([TOPIC])
    got = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            msgs = c.poll(0.5)
            for m in msgs:
                if m.error() is None:
                    got += 1
                    c.acknowledge(m, AcknowledgeType.RELEASE)
            if msgs:
                c.commit_sync(10)
    finally:
        c.close()
    return got


@contextlib.contextmanager
def _broker(args, group: str):
    """The run's broker with its topics and the group's settings: the embedded one, or a real broker
    started from ``--kafka-start`` (stopped and removed at the end)."""
    if not args.kafka_start:
        from spark_share.embedded import EmbeddedKafka

        with EmbeddedKafka(record_lock_duration_ms=args.lock_ms, session_timeout_ms=6000) as kafka:
            kafka.create_topic(TOPIC, args.partitions)
            kafka.create_topic(DLQ, 1)
            yield kafka
        return
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewTopic,
        ResourceType,
    )

    from harness.kafka_kit import KitCluster

    with KitCluster(os.path.abspath(args.kafka_start)) as kit:
        admin = AdminClient({"bootstrap.servers": kit.bootstrap_servers})
        for f in admin.create_topics([NewTopic(TOPIC, args.partitions, 1), NewTopic(DLQ, 1, 1)],
                                     operation_timeout=30).values():
            f.result(60)
        settings = {"share.auto.offset.reset": "earliest", "share.record.lock.duration.ms": str(args.lock_ms),
                    "share.session.timeout.ms": "6000"}
        resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in settings.items()])
        for f in admin.incremental_alter_configs([resource]).values():
            f.result(60)
        yield kit


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0, help="how long faults are injected (default 3)")
    ap.add_argument("--seed", type=int, default=1, help="fixes the fault schedule (default 1)")
    ap.add_argument("--out", default="chaos-out", help="directory for the report, samples and plot")
    ap.add_argument("--rate", type=float, default=100.0, help="records produced per second (default 100)")
    ap.add_argument("--mean-gap", type=float, default=12.0, help="mean seconds between faults (default 12)")
    ap.add_argument("--lock-ms", type=int, default=6000, help="record lock duration of the group (default 6000)")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--faults", default=None,
                    help=f"kinds to draw from (default all: {','.join(FAULTS)}; with --kafka-start: "
                         f"{','.join(REAL_FAULTS)})")
    ap.add_argument("--kafka-start", default=None, metavar="SCRIPT",
                    help="run on a real Kafka >= 4.2 broker started from this script (the kit's interface, "
                         "e.g. tests/harness/kafka_dist/start.sh with KAFKA_HOME set) instead of the embedded broker")
    ap.add_argument("--sample-every", type=float, default=3.0, help="seconds between resource samples (default 3)")
    ap.add_argument("--warmup", type=float, default=None,
                    help="seconds before growth is judged (default: a third of the run, at most 300)")
    ap.add_argument("--drain-timeout", type=float, default=300.0,
                    help="seconds allowed after the faults end for every record to arrive (default 300)")
    args = ap.parse_args(argv)
    known = REAL_FAULTS if args.kafka_start else FAULTS
    kinds = tuple(k for k in (args.faults or ",".join(known)).split(",") if k)
    bad = set(kinds) - set(known)
    if bad:
        ap.error(f"--faults: unknown {sorted(bad)} on this broker; known: {', '.join(known)}")
    seconds = args.minutes * 60
    warmup = args.warmup if args.warmup is not None else min(300.0, seconds / 3)

    from harness import resources

    out = os.path.abspath(args.out)
    runtime = os.path.join(out, "runtime")
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    faults = schedule(args.seed, seconds, args.mean_gap, kinds)
    print(f"chaos: seed {args.seed}, {len(faults)} faults in {args.minutes:g} min: "
          + ", ".join(f"{k} {n}" for k, n in sorted(Counter(f.kind for f in faults).items())), flush=True)
    group = f"chaos-{args.seed}-{os.getpid()}"
    report: dict = {"seed": args.seed, "minutes": args.minutes, "rate": args.rate, "lock_ms": args.lock_ms,
                    "broker": "real (" + args.kafka_start + ")" if args.kafka_start else "embedded"}
    with _broker(args, group) as kafka:
        produced = Produced(kafka.bootstrap_servers, args.rate, args.partitions)
        dead = DeadLetters(kafka.bootstrap_servers, group + "-dlq-reader")
        sink = os.path.join(out, "sink.jsonl")
        env = dict(os.environ, SPARK_SHARE_RUNTIME_DIR=runtime, PYSPARK_PYTHON=sys.executable,
                   PYSPARK_DRIVER_PYTHON=sys.executable)
        query_log = open(os.path.join(out, "query.log"), "wb")
        query = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "query", "--bootstrap", kafka.bootstrap_servers,
             "--group", group, "--out", out, "--lock-ms", str(args.lock_ms)],
            stdin=subprocess.PIPE, stdout=query_log, stderr=subprocess.STDOUT, env=env)
        sampler = resources.ResourceSampler(query.pid, runtime, os.path.join(out, "checkpoint"),
                                            interval=args.sample_every,
                                            extra_logs=(os.path.join(out, "query.log"),),
                                            py4j_counts=os.path.join(out, "py4j.json"),
                                            query_events=os.path.join(out, "query-events.jsonl")).start()
        t0 = time.time()
        operator = Operator(kafka, query, runtime, faults, args.seed, t0)
        try:
            produced.start()
            operator.start()
            while time.time() < t0 + seconds:
                if query.poll() is not None:
                    raise SystemExit(f"chaos: the query process ended early (exit {query.returncode}); "
                                     f"see {out}/query.log")
                time.sleep(min(1.0, t0 + seconds - time.time()))  # the run's clock; nothing to wait on
            operator.stop()
            left = produced.stop()
            print(f"chaos: faults over; {len(produced.ids)} produced ({left} unflushed); draining", flush=True)

            def arrived():
                return produced.ids <= {i for b in read_sink(sink) for i in b["ids"]} | set(dead.ids())

            deadline = time.time() + args.drain_timeout
            while not arrived() and time.time() < deadline and query.poll() is None:
                time.sleep(1.0)  # bounded wait for the sink file and the dead-letter topic to fill
            drained_after = time.time() - (t0 + seconds)
        finally:
            if query.poll() is None:
                query.stdin.write(b'{"command": "stop"}\n')
                query.stdin.flush()
                try:
                    query.wait(180)
                except subprocess.TimeoutExpired:
                    query.kill()
                    query.wait()
            samples = sampler.stop()
            operator.stop()
            query_log.close()
        report["query_exit"] = query.returncode
        dead.close()
        dead.read_to_end()
        dead_ids = dead.ids()
        dead_records = dead.records
        left_in_group = group_left(kafka.bootstrap_servers, group)
        produced.producer.flush(10)

    # --- the checks ---------------------------------------------------------------------------------
    batches = read_sink(sink)
    events = [json.loads(line) for line in open(os.path.join(out, "query-events.jsonl"))]
    written = [i for b in batches for i in b["ids"]]
    seen = Counter(written) + Counter(dead_ids)
    lost = sorted(produced.ids - set(seen))
    unknown = sorted(set(seen) - produced.ids)
    deliveries: dict[int, list] = defaultdict(list)
    for b in batches:
        for i in b["ids"]:
            deliveries[i].append((b["start"], b["end"], f"batch {b['batch']}"))
    for i, when in dead_records:
        deliveries[i].append((when, when, "dead letter"))
    repeated = {i: sorted(ds) for i, ds in deliveries.items() if len(ds) > 1}
    combos, unexplained = explain_duplicates(repeated, faults, args.lock_ms / 1000)
    injected = [f for f in faults if f.started is not None]
    failures = [e for e in events if e["event"] == "failed"]
    unexplained_failures = [e for e in failures if not any(
        f.started <= e["t"] <= (f.ended or f.started) + FAILURE_AFTER_FAULT_S for f in injected)]
    verdicts = resources.growth_verdict(samples, warmup)
    growing = [v for v in verdicts if v.grows]
    poison = {i for i in produced.ids if i % POISON_EVERY == 7}
    report.update({
        "produced": len(produced.ids), "written": len(written), "rejected": len(dead_ids),
        "poison_produced": len(poison), "poison_written": len(poison & set(written)),
        "distinct_delivered": len(seen), "duplicates": sum(c - 1 for c in seen.values() if c > 1),
        "duplicates_by_fault": dict(combos), "unexplained_duplicate_ids": unexplained[:50],
        "lost": len(lost), "lost_ids": lost[:50], "unknown_ids": unknown[:50], "left_in_group": left_in_group,
        "drained_after_s": round(drained_after, 1), "batches": len(batches),
        "query_runs": sum(e["event"] == "started" for e in events),
        "query_failures": [{"t": round(e["t"] - t0, 1), "error": e["error"]} for e in failures],
        "unexplained_failures": len(unexplained_failures),
        "faults": [dict(asdict(f), started=round(f.started - t0, 1) if f.started else None,
                        ended=round(f.ended - t0, 1) if f.ended else None) for f in faults],
        "warmup_s": warmup,
        "growth": [asdict(v) for v in verdicts],
        "rss_mib": {k: {"after_warmup": round(resources.at(samples, warmup)["kinds"][k]["rss_mib"], 1),
                        "end": round(samples[-1]["kinds"][k]["rss_mib"], 1)} for k in resources.KINDS},
        "log_bytes": {"after_warmup": resources.at(samples, warmup)["log_bytes"], "end": samples[-1]["log_bytes"]},
        # pyspark's pinned-thread py4j keeps a connection and a thread per finished query run (see
        # resources.series): reported here, judged apart from the driver's own threads and sockets.
        "py4j_connections_end": samples[-1].get("py4j_connections"),
    })
    problems = []
    if lost:
        problems.append(f"{len(lost)} records lost, e.g. ids {lost[:10]}")
    if unknown:
        problems.append(f"ids never produced were delivered: {unknown[:10]}")
    if poison & set(written):
        problems.append(f"{len(poison & set(written))} poison records reached the sink")
    if unexplained:
        problems.append(f"{len(unexplained)} duplicates follow no fault, e.g. ids {unexplained[:10]}")
    if unexplained_failures:
        problems.append(f"{len(unexplained_failures)} query failures follow no fault: {unexplained_failures[:3]}")
    if left_in_group:
        problems.append(f"the share group still handed out {left_in_group} records after the query stopped")
    if growing:
        problems.append("resources keep growing: " + "; ".join(v.name for v in growing))
    if report["query_exit"] != 0:
        problems.append(f"the query process exited with {report['query_exit']} (see query.log)")
    report["problems"] = problems
    resources.save(samples, os.path.join(out, "resources.json"))
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    try:
        resources.plot(samples, os.path.join(out, "resources.png"),
                       events=[{"t": f.started - t0} for f in injected],
                       title=f"chaos run, seed {args.seed}, {args.minutes:g} min, {len(injected)} faults")
    except ImportError:
        print("chaos: matplotlib is not installed; no plot (pip install -e '.[bench]')", flush=True)

    print(f"\nchaos: produced {report['produced']}, written {report['written']}, rejected {report['rejected']}, "
          f"duplicates {report['duplicates']}, lost {report['lost']}, left in group {left_in_group}; "
          f"{report['batches']} batches in {report['query_runs']} query runs, {len(failures)} failures; "
          f"drained {report['drained_after_s']} s after the faults ended")
    for combo, n in combos.most_common():
        print(f"  duplicates after {combo}: {n}")
    print(f"growth after a {warmup:.0f} s warm-up (samples every {args.sample_every:g} s):")
    for v in verdicts:
        if not v.name.endswith(" n") or v.grows:
            print("  " + v.line())
    if report["py4j_connections_end"] is not None:
        print(f"py4j callback connections kept by the driver at the end: {report['py4j_connections_end']} "
              f"(pyspark's pinned threads: one per query run; {report['query_runs']} runs)")
    print("RSS MiB after warm-up -> end: " + ", ".join(
        f"{k} {v['after_warmup']} -> {v['end']}" for k, v in report["rss_mib"].items()))
    if problems:
        listed = "\n  - ".join(problems)
        print(f"\nchaos: FAILED (seed {args.seed}):\n  - {listed}")
        return 1
    print(f"\nchaos: passed (seed {args.seed}); report in {out}/report.json")
    return 0


# --- the query process (the user's Spark application) -----------------------------------------------
def query_main(argv) -> int:
    ap = argparse.ArgumentParser(prog="chaos.py query")
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lock-ms", type=int, required=True)
    args = ap.parse_args(argv)

    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import spark_share

    spark = (SparkSession.builder.master("local[2,4]").appName("spark-share-chaos")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
             .config("spark.driver.memory", "1g").config("spark.sql.streaming.stopTimeout", "60s")
             # The whole heap is committed at start: RSS then shows what grows outside it (a heap
             # that fills up ends in OutOfMemoryError, a query failure the verdict reports).
             .config("spark.driver.extraJavaOptions", "-Xms1g -XX:+AlwaysPreTouch")
             # The checkpoint keeps this many batches (Spark's default: 100): it stops growing sooner.
             .config("spark.sql.streaming.minBatchesToRetain", "20")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark_share.register(spark)
    armed: set[str] = set()
    restart, stop = threading.Event(), threading.Event()
    lock = threading.Lock()
    sink = open(os.path.join(args.out, "sink.jsonl"), "a")
    events = open(os.path.join(args.out, "query-events.jsonl"), "a")

    def event(kind: str, **more):
        events.write(json.dumps({"t": time.time(), "event": kind, **more}) + "\n")
        events.flush()

    def commands():
        for line in sys.stdin:  # JSON lines from the operator; never anything but JSON
            what = json.loads(line).get("command")
            if what in ("raise", "slow"):
                with lock:
                    armed.add(what)
            elif what == "restart":
                restart.set()
            elif what == "stop":
                break
        stop.set()

    threading.Thread(target=commands, name="commands", daemon=True).start()

    def count_py4j():  # for the sampler: connections py4j keeps for JVM threads (see resources.series)
        callback = spark.sparkContext._gateway._callback_server
        path = os.path.join(args.out, "py4j.json")
        while not stop.wait(1.0):
            with open(path + ".tmp", "w") as f:
                json.dump({"py4j_connections": len(list(callback.connections))}, f)
            os.replace(path + ".tmp", path)

    threading.Thread(target=count_py4j, name="py4j-count", daemon=True).start()

    def take(what: str) -> bool:
        with lock:
            if what in armed:
                armed.discard(what)
                return True
        return False

    def process(df, batch_id):
        start = time.time()
        kind = F.get_json_object(F.col("value").cast("string"), "$.kind")
        rows = df.select(F.col("key").cast("string").alias("id"), kind.alias("kind"), "deliveryCount",
                         "topic", "partition", "offset").collect()
        if take("slow"):
            time.sleep(args.lock_ms / 1000 + 2)  # outlive the records' lock
        poison = [r for r in rows if r["kind"] is None]
        retry = [r for r in rows if r["kind"] == "retry" and r["deliveryCount"] == 1]
        if poison:  # as a DataFrame: a second action on the batch
            spark_share.reject(df.where(kind.isNull()), reason="not JSON")
        if retry:
            spark_share.release(retry)
        ids = [int(r["id"]) for r in rows if r["kind"] is not None and not (r["kind"] == "retry"
                                                                            and r["deliveryCount"] == 1)]
        sink.write(json.dumps({"batch": batch_id, "start": start, "end": time.time(), "ids": ids,
                               "rejected": len(poison), "released": len(retry)}) + "\n")
        sink.flush()
        if take("raise"):
            raise RuntimeError(f"chaos: foreachBatch raised after writing batch {batch_id}")

    def start():
        q = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", args.bootstrap)
             .option("kafka.group.id", args.group).option("subscribe", TOPIC).option("numPartitions", "2")
             .option("readMode", "executors")  # it kills agents
             .option("deadLetterTopic", DLQ).option("maxDeliveryCount", "4").option("idleProbeIntervalMs", "2000")
             .load().writeStream.foreachBatch(process)
             .option("checkpointLocation", os.path.join(args.out, "checkpoint"))
             .trigger(processingTime="1 second").start())
        event("started", id=q.id, run_id=q.runId)
        return q

    def failed(e: Exception) -> None:
        err = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        event("failed", error=err)
        print(f"query failed: {err}", flush=True)

    def restarted():
        """A new run of the query, or None when starting it failed (a killed Python worker can be the
        one planning the source): the loop tries again, as a supervisor would."""
        try:
            return start()
        except Exception as e:
            failed(e)
            return None

    q = start()
    failures_in_a_row = 0
    while not stop.is_set():
        if q is None:
            failures_in_a_row += 1
        else:
            try:
                ended = q.awaitTermination(0.5)
            except Exception as e:
                ended = True
                failed(e)
            if restart.is_set() and not stop.is_set():
                restart.clear()
                q.stop()
                event("stopped")
                ended = True
            if not ended or stop.is_set():
                continue
            failures_in_a_row = failures_in_a_row + 1 if q.lastProgress is None else 0
        if failures_in_a_row > 20:
            print("query keeps failing before its first batch; giving up", flush=True)
            return 3
        q = restarted()
        if q is None:
            stop.wait(1.0)
    if q is not None:
        q.stop()
        event("stopped")
    spark.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "query":
        sys.exit(query_main(sys.argv[2:]))
    sys.exit(main())
