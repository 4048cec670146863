"""The share consumers, in both read modes: an agent serves one query run's consumers on a host
(``readMode=executors``: a process of its own on each executor host; ``readMode=driver``: threads of the
source runner, started by ``spark_share.driver.reads``).

``agent`` answers the tracker and the read tasks; ``pool`` and ``session`` hold the share consumers (one
thread each); ``records`` turns a poll into Arrow; ``deadletter`` writes rejected records. Nothing here
decides when a batch is acknowledged: the tracker (``spark_share.driver``) says so after Spark commits it.
Imports nothing from ``driver`` or ``executor``: both build on this.
"""
