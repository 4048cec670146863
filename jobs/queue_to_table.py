"""Drain a Kafka share group into a Parquet table; bad records go to a dead-letter table.

    python jobs/queue_to_table.py                           # embedded broker, synthetic orders
    python jobs/queue_to_table.py --config conf/local.json  # a real cluster
    spark-submit jobs/queue_to_table.py --config conf/...   # Databricks / EMR (spark-share installed)

The logic lives in spark_share.job so that it is versioned and tested with the source.
"""
import sys

from spark_share.job import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
