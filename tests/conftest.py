"""Fixtures shared by the whole run: one local Spark session, a fresh embedded broker per test."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests import support.py
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def spark():
    """local[2,2]: two cores, and one retry per task so that task-retry tests can inject a failure."""
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2,2]").appName("spark-share-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "2g")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def kafka():
    """A fresh embedded broker (librdkafka's mock cluster) for one test; destroyed after it."""
    from spark_share.embedded import EmbeddedKafka

    with EmbeddedKafka() as cluster:
        yield cluster
