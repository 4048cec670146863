"""The orders pipeline: one streaming table, ``orders``, that drains a Kafka share group. Each record
becomes one row: the order's fields where its value parses, ``valid`` false (and the value kept as
text) where it does not, so that a bad record is kept, not dropped, and can be queried apart
(``WHERE NOT valid``); transformations/invalid_orders.py copies those to a sink.

One flow reads kafka-share: every flow that reads the format is a query of its own, a member of the
share group, and would take records from the others. The source is registered in every session of a
Spark whose Python has spark-share (the module ``pyspark_kafka_share``); ``spark_share.register(spark)``
is not needed here, and where it is called it keeps that registration (docs/deploy.md, "Declarative
pipelines", says why).

Each update drains what is queued when it starts and ends; a record is acknowledged (ACCEPT) once the
batch that wrote it is in the flow's commit log. The settings come from the pipeline's configuration.
"""
from pyspark import pipelines as dp
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

ORDER = "order_id long, customer string, amount double, status string, ts double"
spark = SparkSession.active()  # the pipeline's session (Spark 4.3 also passes it to this file as `spark`)
conf = spark.conf  # the pipeline's configuration (spark-pipeline.yml)


@dp.table(comment="Orders from the share group; valid = false: the value is not an order (kept as text).")
def orders():
    queue = (spark.readStream.format("kafka-share")
             .option("kafka.bootstrap.servers", conf.get("orders.kafka.bootstrap.servers"))
             .option("kafka.group.id", conf.get("orders.kafka.group.id"))
             .option("subscribe", conf.get("orders.subscribe"))
             .option("maxDeliveryCount", conf.get("orders.maxDeliveryCount", "4"))
             .option("deadLetterPath", conf.get("orders.deadLetterPath"))
             .load())
    order = F.from_json(F.col("value").cast("string"), ORDER)
    valid = order.isNotNull() & order.order_id.isNotNull() & order.amount.isNotNull()
    return (queue.withColumn("order", order).withColumn("valid", F.coalesce(valid, F.lit(False)))
            .select("order.*", "valid",
                    F.when(~F.col("valid"), F.col("value").cast("string")).alias("invalid_value"),
                    F.col("key").cast("string").alias("key"), "topic", "partition", "offset", "deliveryCount",
                    F.col("timestamp").alias("kafka_timestamp")))
