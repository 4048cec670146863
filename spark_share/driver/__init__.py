"""Driver side: runs in the reader's runner process (``python_streaming_source_runner``) next to Spark's driver.

``tracker`` owns the query run (batches, claims, the stop) and its server; ``batches`` is its plain data;
``policy`` decides when a batch runs and how big it may be; ``acks`` sends a committed batch's
acknowledgements; ``watermarks`` and ``backlog`` watch the partitions; ``commitlog`` reads Spark's commit log.
Nothing here holds a share consumer: those live on the executors (``spark_share.executor``).
"""
