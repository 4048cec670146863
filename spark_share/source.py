"""The ``kafka-share`` data source: name, schema, options; hands out the stream reader.

Must never: open a connection or start a thread (instances are created and pickled in
short-lived Python workers).
"""
from __future__ import annotations

import os

from pyspark.sql.datasource import DataSource

from .consumers.records import spark_schema, spark_struct
from .options import EXCHANGE_METADATA, parse_options
from .spark_versions import SCHEMA_METADATA


class KafkaShareDataSource(DataSource):
    """``spark.readStream.format("kafka-share")``: Kafka share groups (KIP-932) as a stream.

    Each row is one record a share consumer acquired; it is acknowledged (ACCEPT, or the verdict
    given with :func:`spark_share.reject` / :func:`spark_share.release`) only once Spark has
    committed the batch, so a failure before the commit redelivers it.

    Parameters
    ----------
    options : dict
        ``kafka.bootstrap.servers``, ``kafka.group.id`` and ``subscribe`` are required; any other
        ``kafka.*`` option goes to the share consumer; the source's own options (``numPartitions``,
        ``maxRecordsPerTrigger``, ``deadLetterTopic``, ...) are listed in docs/options.md. A bad option
        raises :class:`spark_share.OptionError` naming it.

    Examples
    --------
    >>> import spark_share
    >>> spark_share.register(spark)  # doctest: +SKIP
    >>> q = spark_share.drain(spark.readStream.format("kafka-share")  # doctest: +SKIP
    ...      .option("kafka.bootstrap.servers", "localhost:9092")
    ...      .option("kafka.group.id", "orders-app")
    ...      .option("subscribe", "orders")
    ...      .load()
    ...      .writeStream.format("parquet").option("path", "/data/orders")
    ...      .option("checkpointLocation", "/chk/orders"))
    """

    # Where the driver side binds (SPARK_SHARE_MASTER, SPARK_SHARE_DRIVER_HOST): a classic session
    # passes them in the SparkContext's environment; under Spark Connect ``register()`` sets them on
    # a subclass, which travels to the server by value.
    cluster_env: dict[str, str] = {}

    @classmethod
    def name(cls) -> str:
        return "kafka-share"

    def __init__(self, options):
        super().__init__(options)
        self.share_options = parse_options(dict(options))

    def schema(self):
        o = self.share_options
        # Spark < 4.2 fails a query whose Python source's schema carries metadata: there the user's code
        # names the location itself (reject(rows, exchange_location=...)).
        if o.exchange_location is None or not SCHEMA_METADATA:
            return spark_schema(o.include_headers)
        # The batch's DataFrame carries the location to reject()/release() in the user's code, which sees
        # no option of the source's: in the metadata of its offset column, which Spark keeps.
        return spark_struct(o.include_headers, {EXCHANGE_METADATA: o.exchange_location})

    def streamReader(self, schema):
        from .reader import ShareStreamReader

        for k, v in self.cluster_env.items():
            os.environ.setdefault(k, v)
        return ShareStreamReader(self.share_options)

    def __getstate__(self):
        # Spark pickles the source; the raw options hold secrets, the parsed ones are enough.
        state = dict(self.__dict__)
        state["options"] = {}
        return state
