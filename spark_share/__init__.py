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

from ._version import __version__
from .errors import (
    AgentError,
    ArgumentError,
    AuthError,
    BatchRefused,
    ConfigError,
    DeadLetterError,
    EmbeddedKafkaError,
    JobError,
    OptionError,
    PeerConnectionError,
    ProtocolError,
    RemoteError,
    RuntimeDirError,
    SourceError,
    SparkShareError,
    UnsupportedSparkError,
    VerdictError,
)

__all__ = ["register", "reject", "release", "status", "drain", "__version__", "SparkShareError", "OptionError",
           "ConfigError", "SourceError", "BatchRefused", "VerdictError", "DeadLetterError", "EmbeddedKafkaError",
           "AuthError", "RemoteError", "AgentError", "ArgumentError", "JobError", "PeerConnectionError", "ProtocolError",
           "RuntimeDirError", "UnsupportedSparkError"]


def register(spark) -> None:
    """Register ``format("kafka-share")`` and the commit listener with a Spark session.

    The listener tells the source promptly when a batch has committed, so its records are
    acknowledged within about a second even under a long ``processingTime`` trigger. Safe to call
    more than once.

    Parameters
    ----------
    spark : pyspark.sql.SparkSession
        The session whose ``readStream`` gets the ``kafka-share`` format.

    Examples
    --------
    >>> import spark_share
    >>> spark_share.register(spark)  # doctest: +SKIP
    >>> df = (spark.readStream.format("kafka-share")  # doctest: +SKIP
    ...       .option("kafka.bootstrap.servers", "localhost:9092")
    ...       .option("kafka.group.id", "orders-app")
    ...       .option("subscribe", "orders")
    ...       .load())
    """
    from . import spark_versions  # a clear error where PySpark is missing or older than 4.0

    spark_versions.require()
    if spark_versions.in_pipeline_definitions():  # Spark >= 4.1
        # A source registered from a pipeline's client makes `spark-pipelines run` fail after its run
        # (docs/deploy.md); the installed package's static registration serves the flows instead.
        from pyspark.pipelines.logging_utils import log_with_curr_timestamp  # the pipeline's own log lines

        log_with_curr_timestamp(
            "spark_share.register: in a pipeline's definitions file, format('kafka-share') is the one the "
            "installed spark-share registers by itself; left as it is (a source registered from here would "
            "fail spark-pipelines run after its run)")
        return
    from .user.listener import install_listener

    spark.dataSource.register(_source_for(spark))  # replaces pyspark_kafka_share's static one (Spark >= 4.2)
    install_listener(spark)


def _source_for(spark):
    """The data source class to register. The source's driver side binds its socket to loopback
    only in local mode; it runs in a process Spark starts on the driver, which learns the master
    from the SparkContext's environment (classic) or from a subclass that carries it (Spark
    Connect: no SparkContext in the client; the class is sent to the server by value)."""
    from .connect import is_connect
    from .driver.policy import PARALLELISM_ENV
    from .source import KafkaShareDataSource

    found = {}
    if is_connect(spark):
        for key, conf in (("SPARK_SHARE_MASTER", "spark.master"), ("SPARK_SHARE_DRIVER_HOST", "spark.driver.host"),
                          (PARALLELISM_ENV, "spark.default.parallelism")):
            try:
                value = spark.conf.get(conf, None)
            except Exception:  # a Connect service may hide its confs; loopback then, or SPARK_SHARE_BIND_HOST
                value = None
            if value:
                found[key] = value
        return type("KafkaShareDataSourceOnConnect", (KafkaShareDataSource,), {"cluster_env": found})
    sc = spark.sparkContext
    sc.environment["SPARK_SHARE_MASTER"] = sc.master
    # The task slots Spark has now: the default numPartitions (more read tasks than slots only
    # queue behind each other, each paying a task's fixed cost).
    sc.environment[PARALLELISM_ENV] = str(sc.defaultParallelism)
    host = sc.getConf().get("spark.driver.host")
    if host:
        sc.environment["SPARK_SHARE_DRIVER_HOST"] = host
    return KafkaShareDataSource


def reject(rows, reason=None, exchange_location=None) -> int:
    """REJECT these rows of the current batch once it commits: the broker archives them.

    Call inside ``foreachBatch``. With a dead-letter target (``deadLetterTopic`` or
    ``deadLetterPath``) the rows are written there, with ``reason``, before the REJECT is sent.
    Nothing is acknowledged until Spark commits the batch; if it fails, the rows come back.

    Parameters
    ----------
    rows : pyspark.sql.DataFrame or iterable of Row
        Rows of the batch being processed, with the source's ``topic``, ``partition`` and
        ``offset`` columns.
    reason : str, optional
        Why; stored with the dead letter.
    exchange_location : str, optional
        The source's ``exchangeLocation``, where the platform runs this code apart from the source's
        process and the rows do not name it themselves: on Spark < 4.2 (whose batches cannot carry
        it in their schema), or rows collected to a list.

    Returns
    -------
    int
        How many rows were given the verdict.

    Raises
    ------
    VerdictError
        Called outside ``foreachBatch`` of a kafka-share query, rows of another batch or without
        the coordinate columns, or rows already released.

    Examples
    --------
    >>> def process(batch, batch_id):  # doctest: +SKIP
    ...     parsed = batch.withColumn("order", from_json(col("value").cast("string"), schema))
    ...     spark_share.reject(parsed.where("order IS NULL"), reason="unparseable JSON")
    ...     parsed.where("order IS NOT NULL").write.mode("append").parquet("/data/orders")
    >>> query = df.writeStream.foreachBatch(process).start()  # doctest: +SKIP
    """
    from .user.verdicts import reject as _reject

    return _reject(rows, reason=reason, exchange_location=exchange_location)


def release(rows, exchange_location=None) -> int:
    """RELEASE these rows of the current batch once it commits: they are delivered again.

    Each delivery raises the record's ``deliveryCount``; past ``maxDeliveryCount`` (if set) a
    record is rejected to the dead-letter target instead of reaching ``foreachBatch`` again.

    Parameters
    ----------
    rows : pyspark.sql.DataFrame or iterable of Row
        Rows of the batch being processed, with ``topic``, ``partition`` and ``offset``.
    exchange_location : str, optional
        As for :func:`reject`.

    Returns
    -------
    int
        How many rows were given the verdict.

    Raises
    ------
    VerdictError
        As for :func:`reject`.

    Examples
    --------
    >>> def process(batch, batch_id):  # doctest: +SKIP
    ...     spark_share.release(batch.where("value IS NULL AND deliveryCount < 3"))  # look again later
    ...     batch.where("value IS NOT NULL").write.mode("append").parquet("/data/orders")
    """
    from .user.verdicts import release as _release

    return _release(rows, exchange_location=exchange_location)


def drain(writer):
    """Start ``writer`` as a scheduled drain: it reads what the queue holds now, acknowledges it and
    stops, on every supported Spark. Use it where you would write ``.trigger(availableNow=True)``.

    Spark >= 4.2 runs ``Trigger.AvailableNow`` of a Python source to the end: there this is that
    trigger. Spark 4.0 and 4.1 run it as one batch and end with records still queued (spark-share
    refuses such a query); there the query runs with the default trigger until its source has read and
    acknowledged what was queued when it started, and is then stopped. ``maxRecordsPerTrigger`` applies
    on every version.

    Parameters
    ----------
    writer : pyspark.sql.streaming.DataStreamWriter
        ``df.writeStream...`` of a ``format("kafka-share")`` stream, ready to ``start()`` (sink,
        ``checkpointLocation``, ``foreachBatch``); its trigger is set here.

    Returns
    -------
    pyspark.sql.streaming.StreamingQuery
        The started query: ``awaitTermination()`` returns once the drain is done, and raises if the
        query failed.

    Raises
    ------
    UnsupportedSparkError
        Under Spark Connect on Spark 4.0/4.1 with the Connect server on another host.

    Examples
    --------
    >>> q = spark_share.drain(stream.writeStream.foreachBatch(process)  # doctest: +SKIP
    ...                       .option("checkpointLocation", "/chk/orders"))
    >>> q.awaitTermination()  # doctest: +SKIP
    """
    from .user.drain import drain as _drain

    return _drain(writer)


def status(query) -> dict:
    """The driver-side view of a kafka-share query: while it runs, or its final counts once it ended.

    Parameters
    ----------
    query : pyspark.sql.streaming.StreamingQuery
        A query that reads ``kafka-share``, started in this process (running, or ended: then the
        counts its tracker left when the run stopped, with ``"view": "final"``).

    Returns
    -------
    dict
        The progress counts (``acquired``, ``accepted``, ``released``, ``rejected``, ``expired``,
        ``failed``, ``inflightRecords``, ``agents``, lock headroom) plus the last 20 batches and
        the share sessions that held records.

    Raises
    ------
    VerdictError
        The query is not a running kafka-share query on this host.

    Examples
    --------
    >>> q = df.writeStream.format("noop").start()  # doctest: +SKIP
    >>> spark_share.status(q)["accepted"]  # doctest: +SKIP
    1200
    """
    from .user.client import status as _status

    return _status(query)
