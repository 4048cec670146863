"""``format("kafka-share")`` in every Spark session whose Python has spark-share installed, with no
``spark_share.register(spark)`` call: PySpark looks up top-level modules named ``pyspark_*`` that
define ``DefaultSource`` (a ``DataSource``) when a session first resolves a Python data source, and
registers each under its ``name()``.

Declarative pipelines (``spark-pipelines run``) need this: a data source registered from the client
(``spark.dataSource.register``) makes the pipeline command fail after a successful run (PySpark 4.3,
docs/deploy.md, "Declarative pipelines"); a statically registered one does not. Only on Spark >= 4.1,
which has pipelines: Spark 4.0 refuses ``register()`` over a static source of the same
name (``DATA_SOURCE_ALREADY_EXISTS``), which would break every 4.0 session that calls it.

Must never: raise (every session's lookup imports this module; an error there fails every Python data
source of the session), or import more than the source class.
"""
try:
    from spark_share import spark_versions

    if spark_versions.PIPELINES:
        from spark_share.source import KafkaShareDataSource as DefaultSource  # noqa: F401
except Exception:  # noqa: BLE001 - no PySpark, or one spark-share does not support: no static source
    pass
