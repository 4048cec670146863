"""``format("kafka-share")`` in every Spark session whose Python has spark-share installed, with no
``spark_share.register(spark)`` call: PySpark looks up top-level modules named ``pyspark_*`` that
define ``DefaultSource`` (a ``DataSource``) when a session first resolves a Python data source, and
registers each under its ``name()``.

Declarative pipelines (``spark-pipelines run``) need this: a data source registered from the client
(``spark.dataSource.register``) makes the pipeline command fail after a successful run under PySpark
4.1-4.3 (docs/deploy.md, "Declarative pipelines"); a statically registered one does not.

Must never: import more than the source class (every session's data source lookup imports this
module).
"""
from spark_share.source import KafkaShareDataSource as DefaultSource

__all__ = ["DefaultSource"]
