"""The agent's per-record CPU without Spark: a raw share-consumer loop against the agent's own path.

    .venv/bin/python jobs/agent_pipeline.py [--records 200000] [--runs 3]

The agent's path is what it does per poll: a ShareSession's poll, the conversion to Arrow, the Arrow
IPC the read task gets (and reads back), the acknowledgement. The raw loop polls and acknowledges
each message. Both use 2 consumers on 16 partitions of 100-byte records; the embedded broker runs in
a process of its own (``spark-share broker``) and each measurement in a fresh process, alternating,
so the CPU counted is the consumers' alone. Prints CPU seconds per million records, medians.
Not part of the test run.
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

PARTITIONS = 2 * 8
CONSUMERS = 2


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _conf(bootstrap: str, group: str) -> dict[str, str]:
    return {"bootstrap.servers": bootstrap, "group.id": group, "share.acknowledgement.mode": "explicit",
            "max.poll.records": "16000"}


def raw_loop(bootstrap: str, topic: str, n: int) -> float:
    from confluent_kafka import AcknowledgeType, ShareConsumer

    got = [0] * CONSUMERS

    def run(i):
        c = ShareConsumer(_conf(bootstrap, "raw"))
        c.subscribe([topic])
        while sum(got) < n:
            for m in c.poll(0.2):
                if m.error() is None:
                    c.acknowledge(m, AcknowledgeType.ACCEPT)
                    got[i] += 1
        c.commit_sync(30)
        c.close()

    return _timed(run)


def agent_path(bootstrap: str, topic: str, n: int) -> float:
    import gc

    from spark_share import records
    from spark_share.session import ShareSession

    records.warm_up()
    gc.freeze()  # as the agent does once started
    sessions = [ShareSession(f"s{i}", _conf(bootstrap, "agent"), [topic], False) for i in range(CONSUMERS)]
    for s in sessions:
        s.joined(5).result(10)
    got = [0] * CONSUMERS

    def run(i):
        s, batch = sessions[i], 0
        while sum(got) < n:
            rb, _ = s.poll(batch, i, None, 2000).result(60)
            records.from_ipc(records.to_ipc(rb))  # the agent writes it; a read task reads it
            if rb.num_rows:
                s.acknowledge({}, 30).result(60)
            got[i] += rb.num_rows
            batch += 1

    try:
        return _timed(run)
    finally:
        for s in sessions:
            s.close().result(30)


def _timed(run) -> float:
    threads = [threading.Thread(target=run, args=(i,)) for i in range(CONSUMERS)]
    cpu = _cpu()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _cpu() - cpu


def _produce(bootstrap: str, topic: str, n: int) -> None:
    from confluent_kafka import Producer

    from spark_share.job.workload import produce_waiting

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "batch.num.messages": 10000})
    for i in range(n):
        produce_waiting(p, topic, key=str(i).encode(), value=b"x" * 100, partition=i % PARTITIONS)
    p.flush(60)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--measure", nargs=3, metavar=("KIND", "BOOTSTRAP", "TOPIC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:  # one measurement, in a process of its own
        kind, bootstrap, topic = args.measure
        cpu = (raw_loop if kind == "raw" else agent_path)(bootstrap, topic, args.records)
        print(json.dumps({"cpu_per_m": cpu / args.records * 1e6}))
        return 0
    topics = [f"t{i}" for i in range(2 * args.runs)]
    broker = subprocess.Popen([sys.executable, "-m", "spark_share.cli", "broker",
                               *[a for t in topics for a in ("--topic", f"{t}:{PARTITIONS}")]],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        bootstrap = _bootstrap_of(broker)
        for t in topics:
            _produce(bootstrap, t, args.records)
        out: dict[str, list[float]] = {"raw": [], "agent": []}
        for i, t in enumerate(topics):
            kind = "raw" if i % 2 == 0 else "agent"
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--records", str(args.records),
                                  "--measure", kind, bootstrap, t], capture_output=True, text=True, timeout=600,
                                 check=True)
            out[kind].append(json.loads(res.stdout.strip().splitlines()[-1])["cpu_per_m"])
            print(f"{kind:5s} {out[kind][-1]:.2f} CPU-s per million records", flush=True)
        raw, ours = statistics.median(out["raw"]), statistics.median(out["agent"])
        print(f"medians: raw loop {raw:.2f}, the agent's path {ours:.2f}, ratio {ours / raw:.2f}")
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
