"""spark-share: Kafka share groups ("Queues for Kafka", KIP-932) as a PySpark streaming source.

    import spark_share
    spark_share.register(spark)
    df = (spark.readStream.format("kafka-share")
          .option("kafka.bootstrap.servers", "broker:9092")
          .option("kafka.group.id", "orders")
          .option("subscribe", "orders")
          .load())
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["register", "reject", "release", "status", "__version__"]


def register(spark) -> None:
    """Register ``format("kafka-share")`` with this Spark session, and the listener that tells the
    source promptly when a batch has committed. Safe to call more than once."""
    from .source import KafkaShareDataSource
    from .verdicts import install_listener

    _tell_workers_where_executors_are(spark)
    spark.dataSource.register(KafkaShareDataSource)
    install_listener(spark)


def _tell_workers_where_executors_are(spark) -> None:
    """The source's driver side binds its socket to loopback only in local mode; it runs in a
    process Spark starts with the SparkContext's environment, which is how it learns the master."""
    try:
        sc = spark.sparkContext
    except Exception:  # Spark Connect: no SparkContext here; the driver side falls back to loopback
        return
    sc.environment["SPARK_SHARE_MASTER"] = sc.master
    host = sc.getConf().get("spark.driver.host")
    if host:
        sc.environment["SPARK_SHARE_DRIVER_HOST"] = host


def reject(rows, reason=None) -> int:
    """REJECT these rows of the current batch once it commits (see ``spark_share.verdicts``)."""
    from .verdicts import reject as _reject

    return _reject(rows, reason=reason)


def release(rows) -> int:
    """RELEASE these rows of the current batch once it commits: they are delivered again."""
    from .verdicts import release as _release

    return _release(rows)


def status(query) -> dict:
    """The driver-side view of a running kafka-share query."""
    from .verdicts import status as _status

    return _status(query)
