"""Executor side of ``readMode=executors``: what a read task calls to reach its host's agent
(``read_task``), and finding or starting that agent (``launcher``: ``python -m spark_share.consumers.agent``).
The agent's code is in ``spark_share.consumers``, which both read modes share.
"""
