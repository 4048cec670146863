"""The ``spark-share`` command.

    spark-share broker [--brokers N] [--topic NAME[:PARTITIONS] ...] [--lock-ms MS]
                       [--max-delivery N] [--auto-offset-reset earliest|latest]
    spark-share produce --bootstrap-servers S --topic T [--count N] [--rate R] [--malformed F]
    spark-share demo [args]          (arguments are passed to spark_share.demo.main)
    spark-share status [--json]      (the queries running on this host, from their trackers)
    spark-share --version

Owns: argument parsing and the four subcommands. ``broker`` runs the embedded broker in the
foreground: it prints ``bootstrap.servers=<value>`` as its first line (for scripts), then a line
for humans, and runs until SIGINT/SIGTERM. Subcommands live in ``COMMANDS`` (name -> (help,
add-arguments, run)), so adding one is one entry.

Must never: print a secret, or leave the embedded broker running after it exits.
"""
from __future__ import annotations

import argparse
import importlib
import random
import signal
import sys
import threading
import time
from collections.abc import Callable


# --- broker ---------------------------------------------------------------------------------
def _broker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--brokers", type=int, default=1, help="number of brokers (default 1)")
    p.add_argument("--topic", action="append", default=[], metavar="NAME[:PARTITIONS]",
                   help="create a topic (repeatable), e.g. --topic orders:4")
    p.add_argument("--lock-ms", type=int, default=None, metavar="MS",
                   help="record lock duration of share groups in ms (mock default if omitted)")
    p.add_argument("--max-delivery", type=int, default=None, metavar="N",
                   help="delivery attempts before a record is archived (mock default 5)")
    p.add_argument("--auto-offset-reset", choices=("earliest", "latest"), default="earliest",
                   help="where new share groups start (default earliest)")


def _broker(args: argparse.Namespace) -> int:
    from .embedded import EmbeddedKafka, parse_topic_spec
    from .errors import ArgumentError

    try:
        topics = [parse_topic_spec(t) for t in args.topic]
    except ArgumentError as e:
        print(f"spark-share broker: {e}", file=sys.stderr)
        return 2
    if args.brokers < 1:
        print("spark-share broker: --brokers must be >= 1", file=sys.stderr)
        return 2

    stop = threading.Event()
    previous = {}

    def on_signal(signum, _frame):
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, on_signal)
    try:
        with EmbeddedKafka(args.brokers, auto_offset_reset=args.auto_offset_reset,
                           record_lock_duration_ms=args.lock_ms,
                           max_delivery_attempts=args.max_delivery) as kafka:
            for name, parts in topics:
                kafka.create_topic(name, parts)
            print(f"bootstrap.servers={kafka.bootstrap_servers}", flush=True)
            shown = ", ".join(f"{n}:{p}" for n, p in topics) or "none"
            print(f"embedded Kafka (librdkafka mock cluster, {args.brokers} broker(s), share groups on); "
                  f"topics: {shown}. Ctrl-C to stop.", flush=True)
            # Event.wait with a timeout returns to the interpreter regularly, so the signal
            # handler runs promptly on every platform.
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("embedded Kafka stopped", flush=True)
    return 0


# --- produce --------------------------------------------------------------------------------
def _fraction(text: str) -> float:
    v = float(text)
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return v


def _produce_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap-servers", required=True, help="e.g. the line printed by 'spark-share broker'")
    p.add_argument("--topic", required=True)
    p.add_argument("--count", type=int, default=1000, help="records to produce (default 1000)")
    p.add_argument("--rate", type=float, default=0.0, help="records per second; 0 = unlimited (default)")
    p.add_argument("--malformed", type=_fraction, default=0.0, metavar="FRACTION",
                   help="fraction of records whose value is not JSON (default 0)")
    p.add_argument("--seed", type=int, default=1, help="random seed (default 1)")


def _produce(args: argparse.Namespace) -> int:
    from confluent_kafka import Producer

    from .job.workload import produce_waiting, synthetic_order

    if args.bootstrap_servers.startswith("bootstrap.servers="):
        args.bootstrap_servers = args.bootstrap_servers.split("=", 1)[1]
    errors: list[str] = []

    def on_delivery(err, _msg):
        if err is not None:
            errors.append(str(err))

    p = Producer({"bootstrap.servers": args.bootstrap_servers, "linger.ms": 5})
    rnd = random.Random(args.seed)
    t0 = time.monotonic()
    bad = 0
    for i in range(args.count):
        if args.rate > 0:
            delay = t0 + i / args.rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # rate pacing
        # Orders without a status, stamped with the time they were made; --malformed of them not JSON.
        kind, value = synthetic_order(i, rnd, mix=[("malformed", args.malformed)], rest="no_status",
                                      customers=1000, stamp=True)
        bad += kind == "malformed"
        produce_waiting(p, args.topic, key=str(i).encode(), value=value, on_delivery=on_delivery)
    left = p.flush(60)
    took = time.monotonic() - t0
    ok = args.count - left - len(errors)
    print(f"produced {ok} records ({bad} malformed) to {args.topic} in {took:.1f} s", flush=True)
    if left or errors:
        print(f"spark-share produce: {left} undelivered, {len(errors)} failed"
              + (f" (e.g. {errors[0]})" if errors else ""), file=sys.stderr)
        return 1
    return 0


# --- demo -----------------------------------------------------------------------------------
def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="arguments of the demo (see 'spark-share demo --help')")


def _demo(args: argparse.Namespace) -> int:
    rest = list(args.rest)
    try:
        demo = importlib.import_module("spark_share.demo")
    except ModuleNotFoundError as e:
        if e.name not in ("spark_share.demo",):
            raise
        if "-h" in rest or "--help" in rest:
            print("usage: spark-share demo [args]\n\nThe demo is not available in this installation.")
            return 0
        print("spark-share demo: the demo is not available in this installation (no spark_share.demo)",
              file=sys.stderr)
        return 1
    return int(demo.main(rest) or 0)


# --- status ---------------------------------------------------------------------------------
def _status_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print each tracker's whole status() as JSON")


def _status(args: argparse.Namespace) -> int:
    """One line per kafka-share query running on this host (its tracker, from the registry), without
    touching the query: members per host, records in flight, the backlog estimate, the last batch."""
    import json

    from .transport.protocol import Status, call
    from .user.client import trackers_reachable

    conns = trackers_reachable()
    if not conns:
        print("no kafka-share query runs on this host (as this user)")
        return 0
    for conn in conns:
        try:
            st, _ = call(conn, Status(), timeout=30)
        except Exception as e:  # the query ended meanwhile
            print(f"a tracker did not answer: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        finally:
            conn.close()
        if args.json:
            print(json.dumps(st, sort_keys=True))
            continue
        last = st.get("lastAcked") or {}
        hosts = ", ".join(f"{h} {v['members']}" for h, v in sorted((st.get("hosts") or {}).items())) or "-"
        print(f"query {st.get('query') or '-'} (tracker {st['tracker']}): batch {st['batch']}, in flight {st['inflightRecords']}, "
              f"backlog estimate {st.get('backlogEstimate', '-')}, members per host: {hosts}; "
              f"last batch {last.get('batch', '-')}: acquired {last.get('acquired', 0)}, "
              f"accepted {last.get('accepted', 0)}, held {last.get('holdMs', '-')} ms; totals: acquired "
              f"{st['acquired']}, accepted {st['accepted']}, rejected {st['rejected']}, released "
              f"{st['released']}, expired {st['expired']}, failed {st['failed']}")
    return 0


# --- main -----------------------------------------------------------------------------------
Command = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
COMMANDS: dict[str, Command] = {
    "broker": ("run the embedded Kafka broker (share groups on) until Ctrl-C", _broker_args, _broker),
    "produce": ("produce JSON order records (some malformed, if asked) for manual tests", _produce_args,
                _produce),
    "demo": ("run the demo job on the embedded broker (see 'spark-share demo --help')", _demo_args, _demo),
    "status": ("one line per kafka-share query running on this host: members, in flight, backlog, last batch",
               _status_args, _status),
}
# Subcommands whose arguments (including --help) belong to the code they call.
_PASS_THROUGH = {"demo"}


def build_parser() -> argparse.ArgumentParser:
    from ._version import __version__

    ap = argparse.ArgumentParser(prog="spark-share",
                                 description="Kafka share groups as a PySpark streaming source.")
    ap.add_argument("--version", action="version", version=f"spark-share {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, add_args, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, add_help=name not in _PASS_THROUGH)
        add_args(p)
        p.set_defaults(func=run)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASS_THROUGH:
        # argparse would take a leading --help for itself; hand everything to the subcommand.
        return COMMANDS[argv[0]][2](argparse.Namespace(command=argv[0], rest=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
