"""The ``spark-share`` command: ``broker`` (the embedded broker in the foreground), ``demo`` and
``produce`` (a quick producer for manual tests).

Must never: print a secret, or leave the embedded broker running after it exits.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from typing import List, Optional


def _broker(args) -> int:
    from .embedded import EmbeddedKafka, parse_topic_spec

    topics = [parse_topic_spec(t) for t in args.topic]
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with EmbeddedKafka(args.brokers, auto_offset_reset=args.auto_offset_reset,
                       record_lock_duration_ms=args.lock_ms, max_delivery_attempts=args.max_delivery) as kafka:
        for name, parts in topics:
            kafka.create_topic(name, parts)
        print(f"bootstrap.servers={kafka.bootstrap_servers}", flush=True)
        print(f"embedded Kafka (librdkafka mock cluster, {args.brokers} broker(s)) with share groups; topics: "
              f"{', '.join(f'{n}:{p}' for n, p in topics) or 'none'}. Ctrl-C to stop.", flush=True)
        stop.wait()
    print("embedded Kafka stopped", flush=True)
    return 0


def _produce(args) -> int:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": args.bootstrap_servers, "linger.ms": 5})
    rnd = random.Random(args.seed)
    t0 = time.monotonic()
    bad = 0
    for i in range(args.count):
        if args.rate > 0:
            due = t0 + i / args.rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # pacing, not synchronisation
        if rnd.random() < args.malformed:
            value = b'{"order_id": ' + str(i).encode() + b', "amount": oops'
            bad += 1
        else:
            value = json.dumps({"order_id": i, "customer": f"c{rnd.randrange(1000)}",
                                "amount": round(rnd.uniform(1, 500), 2), "ts": time.time()}).encode()
        while True:
            try:
                p.produce(args.topic, key=str(i).encode(), value=value)
                break
            except BufferError:
                p.poll(0.1)
        p.poll(0)
    left = p.flush(60)
    took = time.monotonic() - t0
    print(f"produced {args.count - left} records ({bad} malformed) to {args.topic} in {took:.1f} s")
    return 1 if left else 0


def _demo(args, rest) -> int:
    from . import demo

    return demo.main(rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spark-share", description="Kafka share groups as a PySpark streaming source.")
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the embedded Kafka broker (with share groups) until Ctrl-C")
    b.add_argument("--brokers", type=int, default=1, help="number of brokers (default 1)")
    b.add_argument("--topic", action="append", default=[], metavar="NAME[:PARTITIONS]",
                   help="create a topic (repeatable), e.g. --topic orders:4")
    b.add_argument("--lock-ms", type=int, default=None, help="record lock duration of share groups in ms")
    b.add_argument("--max-delivery", type=int, default=None, help="delivery attempts before a record is archived")
    b.add_argument("--auto-offset-reset", choices=("earliest", "latest"), default="earliest",
                   help="where new share groups start (default earliest)")
    b.set_defaults(func=_broker)

    d = sub.add_parser("demo", help="run the demo job on the embedded broker (see 'spark-share demo --help')",
                       add_help=False)
    d.set_defaults(func=_demo)

    p = sub.add_parser("produce", help="produce JSON order records for manual tests")
    p.add_argument("--bootstrap-servers", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--count", type=int, default=1000, help="records to produce (default 1000)")
    p.add_argument("--rate", type=float, default=0, help="records per second; 0 = as fast as possible")
    p.add_argument("--malformed", type=float, default=0.0, help="fraction of records that are not valid JSON")
    p.add_argument("--seed", type=int, default=1)
    p.set_defaults(func=_produce)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = build_parser()
    if argv and argv[0] == "demo":
        return _demo(None, argv[1:])
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
