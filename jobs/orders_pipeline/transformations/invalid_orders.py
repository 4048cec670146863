"""A sink for the records that are not orders: a flow from the streaming table ``orders`` into
``invalid_orders``, JSON files under the pipeline's ``orders.invalidPath``, for whoever fixes them.

A pipeline has no ``foreachBatch``, so it cannot REJECT a bad record: ``orders`` ACCEPTs every record it
wrote, and this flow copies the ones that are not orders out of the table, not out of the share group (a
second flow reading kafka-share would be a second member and take records from ``orders``). It runs as a
query of its own after, or alongside, the flow of ``orders``: a record can reach the sink one update after
it reached the table, never twice.
"""
from pyspark import pipelines as dp
from pyspark.sql import SparkSession

spark = SparkSession.active()

dp.create_sink("invalid_orders", format="json", options={"path": spark.conf.get("orders.invalidPath")})


@dp.append_flow(target="invalid_orders")
def invalid_orders_from_the_table():
    return (spark.readStream.table("orders").where("NOT valid")
            .select("key", "invalid_value", "topic", "partition", "offset", "deliveryCount", "kafka_timestamp"))
