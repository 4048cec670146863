"""Records past Kafka 4.2's delivery throttle, and raw share-consumer loops draining them: what the
recovery test (tests/integration/test_recovery.py) and benchmark (benchmarks/recovery.py) compare
kafka-share against, on the same state in separate groups.

Kafka 4.2 throttles the records of a partition whose delivery count has reached max(2, ceil(limit / 2))
(3 for the default limit of 5): a fetch then acquires only a few of them (one alone on its last
attempt) and nothing behind them in that partition (``SharePartition.throttleRecordsDeliveryLimit``;
docs/performance.md). ``bring_past_throttle`` delivers every record of a topic ``deliveries`` times
without accepting it, the way a failure does:

- ``expired``: a consumer acquires records and holds them past the group's record lock (a batch that
  outlived its lock, a stalled sink);
- ``released``: a consumer acquires and RELEASEs them (an application that gives records back);
- ``lost``: a consumer process acquires records and is killed with SIGKILL (a host lost with records
  held); the broker takes them back when their lock expires.

Must never: accept a record while building a state (each must still be in the queue), or leave a
consumer process running.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from confluent_kafka import AcknowledgeType, ShareConsumer

HOW = ("expired", "released", "lost")

_HOLDER = r"""
import json, sys, time
from confluent_kafka import ShareConsumer
cfg = json.loads(sys.stdin.readline())  # client options may hold credentials: never on the command line
c = ShareConsumer({**cfg["client"], "group.id": cfg["group"], "share.acknowledgement.mode": "explicit"})
c.subscribe([cfg["topic"]])
deadline = time.monotonic() + 60
held = 0
while held == 0 and time.monotonic() < deadline:
    held = len(c.poll(0.5))
print(held, flush=True)
sys.stdin.readline()  # held until killed
"""


def _consumer(client: dict, group: str, **conf) -> ShareConsumer:
    return ShareConsumer({**client, "group.id": group, "share.acknowledgement.mode": "explicit", **conf})


def bring_past_throttle(client: dict, group: str, topic: str, n: int, how: str, deliveries: int,
                        lock_s: float, timeout: float = 120.0) -> list[int]:
    """Deliver the records of ``topic`` (``n`` of them) ``deliveries`` times to ``group`` without accepting
    any (``how``: one of HOW; the group's record lock is ``lock_s``). Each round is one poll of one long-lived
    consumer (``max.poll.records`` = ``n``: all of them, as the topic's producer batches allow), so no
    record is acquired twice in a round. Returns the records acquired per round."""
    if how not in HOW:
        raise ValueError(f"how must be one of {HOW}")
    if how == "lost":
        return [_lost_once(client, group, topic, lock_s) for _ in range(deliveries)]
    rounds = []
    c = _consumer(client, group, **{"max.poll.records": str(max(1, n))})
    c.subscribe([topic])
    try:
        for _ in range(deliveries):
            deadline = time.monotonic() + timeout
            msgs: list = []
            while not msgs and time.monotonic() < deadline:
                msgs = [m for m in c.poll(0.5) if m.error() is None]
            if how == "expired":  # held past the lock (a batch that outlived it); the ACCEPT comes too late
                threading.Event().wait(lock_s + 0.5)
            for m in msgs:
                c.acknowledge(m, AcknowledgeType.RELEASE if how == "released" else AcknowledgeType.ACCEPT)
            c.commit_sync(30)
            rounds.append(len(msgs))
    finally:
        c.close()
    return rounds


def _lost_once(client: dict, group: str, topic: str, lock_s: float) -> int:
    """A consumer process that acquires one poll and is killed holding it; back once its lock expired."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(json.dumps({"client": client, "group": group, "topic": topic}) + "\n")
        p.stdin.flush()
        held = int(p.stdout.readline() or 0)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    threading.Event().wait(lock_s + 1.0)  # the broker takes the records back when their lock expires
    return held


def raw_drain(client: dict, group: str, topic: str, n: int, consumers: int, timeout: float,
              newer: set[tuple[int, int]] | None = None) -> dict:
    """``consumers`` raw share-consumer loops (explicit mode: poll, ACCEPT each record, commit_sync)
    drain ``n`` records. Their rate is counted from the first record to the last (the group join
    aside, as kafka-share's after its first batch); ``first_newer_s``, when ``newer`` names records
    produced after the state was built ((partition, offset)), is when the first of those came, from the
    first record."""
    got = [0] * consumers
    fetches = [0] * consumers
    counts: dict[int, int] = {}
    first: list[float] = []
    last = [0.0]
    first_newer: list[float] = []
    done = threading.Event()
    lock = threading.Lock()
    started = time.monotonic()

    def loop(i: int) -> None:
        c = _consumer(client, group)
        c.subscribe([topic])
        try:
            while not done.is_set():
                msgs = [m for m in c.poll(0.5) if m.error() is None]
                fetches[i] += 1
                for m in msgs:
                    c.acknowledge(m, AcknowledgeType.ACCEPT)
                if msgs:
                    c.commit_sync(30)
                now = time.monotonic()
                with lock:
                    got[i] += len(msgs)
                    if msgs:
                        first[:] = first or [now]
                        last[0] = now
                    for m in msgs:
                        counts[m.delivery_count()] = counts.get(m.delivery_count(), 0) + 1
                        if newer and (m.partition(), m.offset()) in newer and not first_newer:
                            first_newer.append(now)
                if sum(got) >= n or now - started > timeout:
                    done.set()
        finally:
            c.close()

    threads = [threading.Thread(target=loop, args=(i,), name=f"raw-{i}") for i in range(consumers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    span = (last[0] - first[0]) if first else 0.0
    return {"records": sum(got), "seconds": span, "rate": sum(got) / span if span > 0 else float("inf"),
            "fetches": sum(fetches), "delivery_counts": dict(sorted(counts.items())),
            "first_newer_s": (first_newer[0] - first[0]) if first_newer and first else None}


def producer_offsets(client: dict, topic: str, count: int, partitions: int) -> list[tuple[int, int]]:
    """Produce ``count`` records of 100 bytes round-robin over ``partitions``: their (partition, offset)."""
    from confluent_kafka import Producer

    placed: list[tuple[int, int]] = []
    p = Producer({**client, "linger.ms": 5, "enable.idempotence": True})
    for i in range(count):
        p.produce(topic, value=os.urandom(50).hex().encode(), key=str(i).encode(), partition=i % partitions,
                  on_delivery=lambda err, m: placed.append((m.partition(), m.offset())) if err is None else None)
        p.poll(0)
    p.flush(60)
    return placed
