"""The embedded broker's synthetic workload: orders to produce, and the demo's config and paths.

Owns: :func:`produce_waiting` (the one produce loop that waits for room instead of failing, used by
the job, ``spark-share produce`` and the benchmarks: benchmarks/bench_common.py), :func:`synthetic_order` (the one generator
of synthetic orders, shared by the job and ``spark-share produce``), :func:`synthetic_orders` (the
job's workload on a topic), :func:`demo_config` and :func:`prepare_embedded_paths` (an embedded
run replaces the tables of the previous embedded run, nothing else).

Must never: touch a path that holds anything but an earlier embedded run's data, write anywhere
but a local path, or lose a produced record silently (undelivered orders are an error).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Sequence

from ..errors import ConfigError, JobError
from .config import JobConfig, parse_config


def produce_waiting(producer, topic: str, **record) -> None:
    """``producer.produce`` that waits for room when the local queue is full instead of failing."""
    while True:
        try:
            producer.produce(topic, **record)
            break
        except BufferError:
            producer.poll(0.1)
    producer.poll(0)


# (kind, share) in order; whatever is left is the ``rest`` kind of synthetic_order ('ok' for the job).
DEMO_MIX: Sequence[tuple[str, float]] = (("malformed", 0.02), ("invalid", 0.01), ("no_status", 0.05),
                                         ("pending", 0.02))


def synthetic_order(i: int, rnd: random.Random, mix: Sequence[tuple[str, float]] = DEMO_MIX, rest: str = "ok",
                    customers: int = 500, stamp: bool = False) -> tuple[str, bytes]:
    """Order ``i`` as (kind, JSON value), its kind drawn from ``mix``: 'malformed' (not JSON),
    'invalid' (no amount), 'no_status' (no status field); any other kind is the order's status.
    ``customers`` is how many distinct customers there are; ``stamp`` adds ``ts``, the time the
    order was made (epoch seconds)."""
    r = rnd.random()
    kind, bound = rest, 0.0
    for k, share in mix:
        bound += share
        if r < bound:
            kind = k
            break
    if kind == "malformed":
        return kind, b'{"order_id": ' + str(i).encode() + b', "amount": '
    if kind == "invalid":
        return kind, json.dumps({"order_id": i, "customer": "c1"}).encode()
    order = {"order_id": i, "customer": f"c{rnd.randrange(customers)}",
             "amount": round(rnd.uniform(1, 900), 2)}
    if kind != "no_status":
        order["status"] = kind
    if stamp:
        order["ts"] = time.time()
    return kind, json.dumps(order).encode()


def synthetic_orders(bootstrap: str, topic: str, n: int, partitions: int, seed: int = 7) -> dict[str, int]:
    """Orders as JSON: ~2 % malformed, ~1 % missing the amount, ~2 % 'pending' (released once),
    ~5 % without a status (release_if is NULL for them: written), the rest 'ok'."""
    from confluent_kafka import Producer

    rnd = random.Random(seed)
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    kinds: Counter[str] = Counter()
    for i in range(n):
        kind, value = synthetic_order(i, rnd)
        kinds[kind] += 1
        produce_waiting(p, topic, key=str(i).encode(), value=value, partition=i % partitions)
    left = p.flush(60)
    if left:
        raise JobError(f"{left} synthetic orders were not delivered to {topic}")
    return dict(kinds)


DEMO_SCHEMA = "order_id long, customer string, amount double, status string"


def demo_config(bootstrap: str, base: str) -> JobConfig:
    return parse_config({
        "source": {"bootstrap_servers": bootstrap, "group_id": "orders-to-table", "topics": ["orders"]},
        "schema": DEMO_SCHEMA,
        "required": ["order_id", "amount"],
        # 'pending' orders hit a transient condition the first time they are seen: try again later.
        "release_if": "rec.status = 'pending' AND deliveryCount = 1",
        "output": {"path": os.path.join(base, "orders"),
                   "dead_letter_path": os.path.join(base, "dead_letters"),
                   "checkpoint_path": os.path.join(base, "checkpoint")},
    })


_MARK = ".spark-share-embedded"


def prepare_embedded_paths(cfg: JobConfig) -> list[str]:
    """An embedded broker lives as long as the run, so the tables and checkpoint of an earlier
    embedded run are removed (they would mix two brokers' offsets). Paths that hold anything
    else are never touched: that is a ConfigError."""
    paths = [("output.path", cfg.output_path), ("output.dead_letter_path", cfg.dead_letter_path),
             ("output.checkpoint_path", cfg.checkpoint_path)]
    for name, p in paths:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", p) and not p.startswith("file:"):
            raise ConfigError(f"config field '{name}': an embedded-broker run writes local paths only, "
                              f"got {p!r}")
    local = [(name, p[len("file:"):] if p.startswith("file:") else p) for name, p in paths]
    def used(p):
        return os.path.isdir(p) and bool(set(os.listdir(p)) - {_MARK})

    for name, p in local:
        if used(p) and not os.path.exists(os.path.join(p, _MARK)):
            raise ConfigError(f"config field '{name}': {p} already holds data that is not from an "
                              "embedded-broker run; give an empty or new directory")
    removed = []
    for name, p in local:
        if used(p):
            shutil.rmtree(p)
            removed.append(p)
        os.makedirs(p, exist_ok=True)
        with open(os.path.join(p, _MARK), "w") as f:
            f.write("written by an embedded-broker run of spark-share's job; removed by the next one\n")
    return removed

