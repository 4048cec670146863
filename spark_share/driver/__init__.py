"""Driver side: runs in the reader's runner process (``python_streaming_source_runner``) next to Spark's driver.

``tracker`` owns the query run (batches, claims, the stop) and its server; ``batches`` is its plain data;
``policy`` decides when a batch runs and how big it may be; ``acks`` sends a committed batch's
acknowledgements; ``watermarks`` and ``backlog`` watch the partitions; ``commitlog`` reads Spark's commit log.
The tracker holds no share consumer: they are an agent's (``spark_share.consumers``), on the executor hosts,
or with ``readMode=driver`` in this process, started by ``reads``, which puts a batch's rows in its partitions.
"""
