"""The shared Spark session fixture works, and so does chispa's DataFrame comparison."""
from __future__ import annotations

import pytest


def test_spark_fixture_runs_jobs(spark):
    assert spark.range(10).count() == 10
    assert spark.sparkContext.master.startswith("local[2")
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    # A shuffle and a Python UDF: executors start Python workers with this interpreter.
    from pyspark.sql import functions as F

    plus_one = F.udf(lambda x: x + 1, "long")
    rows = spark.range(6).groupBy((F.col("id") % 2).alias("k")).agg(F.sum(plus_one("id")).alias("s")).collect()
    assert sorted((r.k, r.s) for r in rows) == [(0, 9), (1, 12)]


def test_chispa_compares_dataframes(spark):
    from chispa import DataFramesNotEqualError, assert_df_equality

    schema = "id long, v string"
    left = spark.createDataFrame([(2, "b"), (1, "a")], schema)
    assert_df_equality(left, spark.createDataFrame([(1, "a"), (2, "b")], schema), ignore_row_order=True)
    with pytest.raises(DataFramesNotEqualError):
        assert_df_equality(left, spark.createDataFrame([(1, "a"), (2, "c")], schema), ignore_row_order=True)
