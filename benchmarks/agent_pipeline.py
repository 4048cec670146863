"""The agent's per-record CPU without Spark: a raw share-consumer loop against the agent's own path.

    .venv/bin/python benchmarks/agent_pipeline.py [--records 200000] [--runs 3] [--consumers 2]

The agent's path is what it does per poll: a ShareSession's poll, the conversion to Arrow, the Arrow
IPC the read task gets (and reads back), the acknowledgement. The raw loop polls and acknowledges
each message. Both use ``--consumers`` consumers on 16 partitions of 100-byte records; the embedded
broker runs in a process of its own (``spark-share broker``) and each measurement in a fresh
process, alternating, so the CPU counted is the consumers' alone. Prints CPU seconds per million
records, medians, in all and by phase: each phase's CPU is counted on the thread that ran it
(``time.thread_time``); "elsewhere" is the rest of the process (librdkafka's threads, the hand-offs
between threads). Not part of the test run. It must never measure in the process that runs the broker
or the other reader: each measurement's CPU is its process's alone.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager

from bench_common import produce

PARTITIONS = 2 * 8


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _conf(bootstrap: str, group: str) -> dict[str, str]:
    return {"bootstrap.servers": bootstrap, "group.id": group, "share.acknowledgement.mode": "explicit",
            "max.poll.records": "16000"}


class Phases:
    """CPU seconds by phase, each counted on the thread that ran it."""

    def __init__(self) -> None:
        self.cpu: Counter[str] = Counter()
        self._lock = threading.Lock()

    @contextmanager
    def timing(self, phase: str):
        start = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - start
            with self._lock:
                self.cpu[phase] += spent

    def timed(self, phase: str, fn):
        def call(*args, **kwargs):
            with self.timing(phase):
                return fn(*args, **kwargs)
        return call


class _TimedConsumer:
    """A session's consumer whose poll and commit_sync count their CPU (the rest passes through)."""

    def __init__(self, consumer, phases: Phases) -> None:
        self._consumer = consumer
        self.poll = phases.timed("consumer.poll", consumer.poll)
        self.commit_sync = phases.timed("commit_sync", consumer.commit_sync)

    def __getattr__(self, name):
        return getattr(self._consumer, name)


def raw_loop(bootstrap: str, topic: str, n: int, consumers: int, phases: Phases) -> float:
    from confluent_kafka import AcknowledgeType, ShareConsumer

    got = [0] * consumers

    def run(i):
        c = ShareConsumer(_conf(bootstrap, "raw"))
        c.subscribe([topic])
        while sum(got) < n:
            with phases.timing("consumer.poll"):
                msgs = c.poll(0.2)
            with phases.timing("acknowledgement calls"):
                for m in msgs:
                    if m.error() is None:
                        c.acknowledge(m, AcknowledgeType.ACCEPT)
                        got[i] += 1
        with phases.timing("commit_sync"):
            c.commit_sync(30)
        c.close()

    return _timed(run, consumers)


def agent_path(bootstrap: str, topic: str, n: int, consumers: int, phases: Phases) -> float:
    import gc

    from spark_share.consumers import records
    from spark_share.consumers.session import ShareSession

    records.warm_up()
    gc.freeze()  # as the agent does once started
    records.to_record_batch = phases.timed("conversion to Arrow", records.to_record_batch)
    sessions = [ShareSession(f"s{i}", _conf(bootstrap, "agent"), [topic], False) for i in range(consumers)]
    for s in sessions:
        s.joined(5).result(10)
        s.consumer = _TimedConsumer(s.consumer, phases)
        s._poll = phases.timed("session poll", s._poll)
        s._acknowledge = phases.timed("session acknowledgement", s._acknowledge)
    got = [0] * consumers

    def run(i):
        s, batch = sessions[i], 0
        while sum(got) < n:
            rb, _ = s.poll(batch, i, None, 2000).result(60)
            with phases.timing("Arrow IPC, written and read"):
                records.from_ipc(records.to_ipc(rb))  # the agent writes it; a read task reads it
            if rb.num_rows:
                s.acknowledge({}, 30).result(60)
            got[i] += rb.num_rows
            batch += 1

    try:
        return _timed(run, consumers)
    finally:
        for s in sessions:
            s.close().result(30)


def by_phase(phases: Phases, total: float) -> dict[str, float]:
    """The phases, with the nested ones taken out of the session's calls that contain them."""
    cpu = dict(phases.cpu)
    if "session poll" in cpu:
        cpu["poll: errors, bookkeeping"] = (cpu.pop("session poll") - cpu["consumer.poll"]
                                            - cpu["conversion to Arrow"])
        cpu["acknowledgement calls"] = cpu.pop("session acknowledgement") - cpu["commit_sync"]
    cpu["elsewhere"] = total - sum(cpu.values())
    return cpu


def _timed(run, consumers: int) -> float:
    threads = [threading.Thread(target=run, args=(i,)) for i in range(consumers)]
    cpu = _cpu()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _cpu() - cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--measure", nargs=3, metavar=("KIND", "BOOTSTRAP", "TOPIC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    per_m = 1e6 / args.records
    if args.measure:  # one measurement, in a process of its own
        kind, bootstrap, topic = args.measure
        phases = Phases()
        cpu = (raw_loop if kind == "raw" else agent_path)(bootstrap, topic, args.records, args.consumers, phases)
        print(json.dumps({"cpu_per_m": cpu * per_m,
                          "phases": {k: v * per_m for k, v in by_phase(phases, cpu).items()}}))
        return 0
    topics = [f"t{i}" for i in range(2 * args.runs)]
    broker = subprocess.Popen([sys.executable, "-m", "spark_share.cli", "broker",
                               *[a for t in topics for a in ("--topic", f"{t}:{PARTITIONS}")]],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        bootstrap = _bootstrap_of(broker)
        for t in topics:
            produce({"bootstrap.servers": bootstrap}, t, args.records, PARTITIONS)
        out: dict[str, list[dict]] = {"raw": [], "agent": []}
        for i, t in enumerate(topics):
            kind = "raw" if i % 2 == 0 else "agent"
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--records", str(args.records),
                                  "--consumers", str(args.consumers), "--measure", kind, bootstrap, t],
                                 capture_output=True, text=True, timeout=600, check=True)
            out[kind].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(f"{kind:5s} {out[kind][-1]['cpu_per_m']:.2f} CPU-s per million records", flush=True)
        raw, ours = (statistics.median(r["cpu_per_m"] for r in out[k]) for k in ("raw", "agent"))
        print(f"medians, {args.consumers} consumer(s): raw loop {raw:.2f}, the agent's path {ours:.2f}, "
              f"ratio {ours / raw:.2f}")
        print(f"{'by phase, medians':34s} {'raw loop':>9s} {'agent':>9s}")
        names = list(dict.fromkeys(k for kind in ("agent", "raw") for r in out[kind] for k in r["phases"]))
        for name in names:
            cells = [statistics.median(r["phases"].get(name, 0.0) for r in out[k]) for k in ("raw", "agent")]
            print(f"{name:34s} {cells[0]:9.2f} {cells[1]:9.2f}")
    finally:
        broker.send_signal(2)
        broker.wait(30)
    return 0


def _bootstrap_of(broker: subprocess.Popen) -> str:
    """The address ``spark-share broker`` prints first (``bootstrap.servers=HOST:PORT``)."""
    assert broker.stdout is not None
    first = broker.stdout.readline().strip()
    if not first.startswith("bootstrap.servers="):
        raise RuntimeError(f"the embedded broker did not start: {first!r}")
    return first.split("=", 1)[1]


if __name__ == "__main__":
    sys.exit(main())
