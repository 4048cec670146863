"""The job file's command line: ``jobs/queue_to_table.py`` and ``spark-share demo`` call :func:`main`.

Owns: argument parsing, finding a relative ``--config`` (current directory, then the repository
root), the Spark session of the run, and the choice between a run against a real broker and one
on the embedded broker with the synthetic workload (no ``--config``, or
``source.bootstrap_servers`` = ``"embedded"``). A ``ConfigError`` ends the run with exit code 2
and its message on stderr.

Must never: print a credential, leave the embedded broker or the Spark session running after it
returns, or hold job logic of its own (that lives in config, pipeline and workload).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence

from ..connect import is_connect
from ..errors import ConfigError
from .config import EMBEDDED, load_config
from .pipeline import print_summary, run
from .workload import demo_config, prepare_embedded_paths, synthetic_orders


def _find_config(path: str, search: Sequence[str]) -> str:
    """A relative --config is looked up in the current directory, then in each of ``search`` (the
    repository root: on Databricks the working directory is the script's, jobs/)."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    for root in search:
        candidate = os.path.join(root, path)
        if os.path.exists(candidate):
            return candidate
    return path


def main(argv=None, prog: str = "queue_to_table.py", search: Sequence[str] = ()) -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Drain a Kafka share group into a Parquet table. "
                                 "Without --config (or with source.bootstrap_servers = \"embedded\"), it "
                                 "starts the embedded broker and produces synthetic orders first.")
    ap.add_argument("--config", help="JSON config (see conf/); without it, run on the embedded broker")
    ap.add_argument("--records", type=int, default=20000,
                    help="synthetic orders per topic for an embedded run")
    ap.add_argument("--out",
                    help="output directory of the run without --config (default: a new temporary directory)")
    ap.add_argument("--remote", metavar="sc://HOST:PORT",
                    help="run through a Spark Connect server (as `spark-submit --remote`; SPARK_REMOTE also works)")
    args = ap.parse_args(argv)
    if args.records < 0:
        ap.error("--records must be >= 0")
    if args.remote and not args.remote.startswith("sc://"):
        ap.error(f"--remote must be a Spark Connect URL, sc://host:port (got {args.remote!r})")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    try:
        if args.config:
            cfg = load_config(_find_config(args.config, search))
        else:
            cfg = demo_config(EMBEDDED, args.out or tempfile.mkdtemp(prefix="spark-share-job-"))
        embedded = cfg.bootstrap_servers == EMBEDDED
        if embedded:
            for p in prepare_embedded_paths(cfg):
                print(f"removed {p} (from an earlier embedded-broker run)", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    remote = args.remote or os.environ.get("SPARK_REMOTE")
    if remote and cfg.spark_master:
        print(f"error: config field 'spark_master' ({cfg.spark_master!r}) and a Spark Connect server "
              f"({'--remote' if args.remote else 'SPARK_REMOTE'}) both say where to run; keep one",
              file=sys.stderr)
        return 2
    builder = SparkSession.builder.appName("spark-share-queue-to-table")
    if args.remote:
        builder = builder.remote(args.remote)
    elif cfg.spark_master or (embedded and not args.config and not remote):
        builder = (builder.master(cfg.spark_master or "local[2]").config("spark.ui.enabled", "false")
                   .config("spark.ui.showConsoleProgress", "false")
                   .config("spark.sql.shuffle.partitions", "2"))
    spark = builder.getOrCreate()
    if not is_connect(spark):  # a Connect server keeps its own log level
        spark.sparkContext.setLogLevel("ERROR")
    try:
        if not embedded:
            s = run(spark, cfg)
            print_summary(spark, cfg, s)
            return 0
        from ..embedded import EmbeddedKafka

        with EmbeddedKafka() as kafka:
            kinds: Counter = Counter()
            for topic in cfg.topics:
                kafka.create_topic(topic, 4)
                kinds.update(synthetic_orders(kafka.bootstrap_servers, topic, args.records, 4))
            produced = args.records * len(cfg.topics)
            print(f"embedded broker {kafka.bootstrap_servers}: produced {produced:,} orders {dict(kinds)}",
                  flush=True)
            cfg = dataclasses.replace(cfg, bootstrap_servers=kafka.bootstrap_servers)
            s = run(spark, cfg)
            print_summary(spark, cfg, s, produced=produced)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
