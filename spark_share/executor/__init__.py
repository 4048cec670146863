"""Executor side: the agent process of each (query run, host) and what a read task calls to reach it.

``agent`` serves the tracker and the read tasks; ``pool`` and ``session`` hold the share consumers (one
thread each); ``records`` turns a poll into Arrow; ``deadletter`` writes rejected records; ``launcher``
finds or starts this host's agent from a read task. Nothing here decides when a batch is acknowledged:
the tracker (``spark_share.driver``) says so after Spark commits it.
"""
