"""What the benchmark scripts share: the paths, the choice of Kafka and its arguments, the local Spark
session, backlogs of records, and the small helpers of their JSON and printed output.

Importing it puts the repository (``spark_share``) and ``tests/`` (the harness: the Kafka to run on, the
process kinds) on ``sys.path``. It must never measure or print a figure itself, and never keep state
from one run to the next: each script decides what it measures and how it reports it.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, os.path.join(ROOT, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def add_kafka_arguments(ap) -> None:
    """A benchmark's Kafka: the embedded broker, or ``--bootstrap-servers`` (a cluster of yours) with
    ``--kafka-option`` client configs (``parse_args`` reads them)."""
    ap.add_argument("--bootstrap-servers", help="a Kafka >= 4.2 cluster of yours instead of the embedded broker "
                    "(topics are created with unique names and deleted; needs create/delete topic and alter group "
                    "config permissions)")
    ap.add_argument("--kafka-option", action="append", default=[], metavar="K=V",
                    help="a client config for that cluster (security.protocol=SASL_SSL, ...); repeatable; "
                    "@FILE reads them from FILE, one per line (keeps credentials off the command line)")


def parse_args(ap, argv):
    """``ap``'s arguments, the client configs as ``kafka_options``, ``--out`` made."""
    from harness.kafka_cluster import cluster_options

    args = ap.parse_args(argv)
    args.kafka_options = cluster_options(ap, args)  # errors name an option by its position: it may be a credential
    os.makedirs(args.out, exist_ok=True)
    return args


def comma_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def comma_set(text: str) -> set[str]:
    return set(filter(None, text.split(",")))


def local_session(floor: bool = False, jars: list[str] | None = None):
    """The benchmarks' Spark: local[2], no UI, spark-share registered; with ``floor``, Spark's floor source
    (bench_floor.py) too; ``jars`` on its classpath (spark.jars)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if floor:  # Spark's Python processes (planning workers, the source runner) import bench_floor.py
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [HERE, ROOT, os.environ.get("PYTHONPATH")]))
    from pyspark.sql import SparkSession

    import spark_share

    builder = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false").config("spark.sql.shuffle.partitions", "2"))
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark_share.register(spark)
    if floor:
        from bench_floor import FloorSource

        spark.dataSource.register(FloorSource)
    return spark


def cluster(args, prefix: str = "spark-share-bench"):
    """A cluster of yours (tests/harness/kafka_cluster.py: topics and groups under a prefix of this run, deleted
    at the end; each share group set to start at the earliest record), or a fresh embedded broker."""
    from harness.kafka_cluster import EmbeddedCluster, ExternalCluster

    if args.bootstrap_servers:
        return ExternalCluster(args.bootstrap_servers, args.kafka_options, prefix=prefix)
    return EmbeddedCluster()


@contextlib.contextmanager
def real_cluster(args, props: dict[str, str], prefix: str):
    """A real Kafka: a broker of the kit (``--kafka-start``) with the broker configs ``props``, removed at the
    end, its processes in ``broker_pids``; or a cluster of yours (``--bootstrap-servers``), as it is."""
    from harness.kafka_cluster import ExternalCluster
    from harness.kafka_kit import KitCluster

    if args.bootstrap_servers:
        with ExternalCluster(args.bootstrap_servers, args.kafka_options, prefix=prefix) as kafka:
            yield kafka
        return
    with KitCluster(args.kafka_start, props=props, heap="1G") as kit:
        with ExternalCluster(kit.bootstrap_servers, {}, prefix=prefix) as kafka:
            kafka.broker_pids = [n.pid() for n in kit.nodes]
            yield kafka


def produce(client: dict, topic: str, n: int, partitions: int, value_bytes: int = 100) -> None:
    """``n`` records of ``value_bytes`` bytes, spread round-robin over the partitions, keyed by their number."""
    from confluent_kafka import Producer

    from spark_share.job.workload import produce_waiting

    p = Producer({**client, "linger.ms": 5, "batch.num.messages": 10000})
    payload = b"x" * value_bytes
    for i in range(n):
        produce_waiting(p, topic, key=str(i).encode(), value=payload, partition=i % partitions)
    p.flush(120)


def backlog(kafka, partitions: int, n: int, value_bytes: int = 100, locks: int | None = None) -> str:
    """A new topic holding ``n`` records; on the embedded broker, its record locks set to ``locks`` (a real
    Kafka keeps its own: the setting is the broker's)."""
    from spark_share.embedded import EmbeddedKafka

    if locks and isinstance(kafka, EmbeddedKafka):
        kafka.set_max_record_locks(locks)
    # A unique name: several backlogs may share one cluster of yours (and its prefix).
    topic = kafka.create_topic(f"t-{uuid.uuid4().hex[:6]}", partitions)
    produce(kafka.client(), topic, n, partitions, value_bytes)
    return topic


def write_json(path: str, results: dict, indent: int = 1) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=indent)


def rounded(row: dict, digits: int) -> dict:
    """``row`` with its floats rounded, for a progress line."""
    return {k: round(v, digits) if isinstance(v, float) else v for k, v in row.items()}


def med(xs) -> float:
    """The median of the values that are there (None left out); NaN when there are none."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else math.nan


def pct(xs, p) -> float:
    """The ``p``-th percentile, nearest rank; NaN for no samples."""
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]
