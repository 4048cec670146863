"""Fixtures of the integration tests: one local Spark session (with kafka-share registered), a fresh
embedded broker per test, and a long-lived producer of records with unique ids."""
from __future__ import annotations

import os
import sys

import pytest

# Executors' Python workers must be this interpreter (the venv with the project installed).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from support import ProducerPool  # noqa: E402


@pytest.fixture(scope="session")
def spark():
    """local[2,2]: two cores, and one retry per task so that task-retry tests can inject a failure."""
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2,2]").appName("spark-share-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "2g")
               .config("spark.sql.streaming.stopTimeout", "60s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    import spark_share

    spark_share.register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture
def kafka():
    """A fresh embedded broker (librdkafka's mock cluster) for one test; destroyed after it."""
    from spark_share.embedded import EmbeddedKafka

    with EmbeddedKafka() as cluster:
        yield cluster


@pytest.fixture
def produce(kafka):
    """``produce(kafka, topic, values_or_count, partitions=None) -> ids``: records with unique ids
    (JSON value with an "id" field, key = id) through one producer per broker that lives until
    the end of the test (a disconnecting client ends every share session on the mock)."""
    pool = ProducerPool()
    try:
        yield pool
    finally:
        pool.close()
