"""Drain a Kafka share group into a Parquet table; bad records go to a dead-letter table.

    python jobs/queue_to_table.py                           # embedded broker, synthetic orders
    python jobs/queue_to_table.py --config conf/local.json  # the same, from a config ("embedded" broker)
    KAFKA_BOOTSTRAP_SERVERS=host:9092 python jobs/queue_to_table.py --config conf/local-broker.json
    spark-submit jobs/queue_to_table.py --config conf/...   # Databricks / EMR (spark-share installed)

A relative --config is looked up in the current directory, then in the repository root (the
directory above jobs/): on Databricks the working directory of a Python file task is the file's.

The logic lives in the package spark_share.job (this command line: spark_share/job/command.py) so
that it is versioned and tested with the source.
"""
import os
import sys

from spark_share.job.command import main

if __name__ == "__main__":
    here = globals().get("__file__")
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(here)))] if here else []
    sys.exit(main(sys.argv[1:], search=roots))
