"""A read task of ``format("kafka-share")``: one (batch, slot) asked of this executor's agent, yielded as Arrow.

Owns: what the task knows of itself (the query id and Spark's batch id from its local properties,
or under Spark Connect the tag of the session that runs the batch), the request to the agent, and
this Python worker's connections to the agents of the query runs it served (kept between tasks: a
worker runs one task at a time).

Must never: hold a Kafka consumer (Python workers come and go: the agent holds them), or keep a
connection to an agent whose run has ended.
"""
from __future__ import annotations

from collections.abc import Iterator

from ..connect import session_of_job_tags
from ..consumers import records
from ..options import ShareSourceOptions
from ..transport.protocol import Read, call

# Per Python worker: the connection to this executor's agent of each query run, kept between tasks.
_AGENTS: dict = {}
READ_TIMEOUT_S = 600.0


def read(partition, opts: ShareSourceOptions) -> Iterator:
    """The rows of ``partition`` (a ``partitions.SharePartition``), from this executor's agent."""
    from pyspark import TaskContext

    ctx = TaskContext.get()
    query_id = ctx.getLocalProperty("sql.streaming.queryId") if ctx else None
    # Spark's batch id can run ahead of ours (no-data batches, other sources): verdicts and commit
    # signals name Spark's, so the tracker learns which of its batches it is.
    spark_batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
    # foreachBatch under Spark Connect runs its jobs without those properties; the tag of the
    # Connect session that runs the batch names it instead (reject() there knows that session).
    connect_session = None if query_id else session_of_job_tags(ctx.getLocalProperty("spark.job.tags") if ctx else None)
    request = Read(partition.batch, partition.slot, partition.max_records, partition.poll_timeout_ms, query_id,
                   int(spark_batch) if spark_batch is not None else None, connect_session)
    timeout = READ_TIMEOUT_S + partition.poll_timeout_ms / 1000.0
    conn = _agent_of(partition.tracker_id)
    if conn is None:
        conn = _connect_agent(partition, opts)
    try:
        _, blob = call(conn, request, timeout=timeout)
    except ConnectionError:  # the agent of an earlier task went away; start or find the current one
        conn.close()
        _, blob = call(_connect_agent(partition, opts), request, timeout=timeout)
    yield from records.from_ipc(blob)


def _agent_of(tracker_id: str):
    """This worker's open connection to the agent of a query run, if any. Connections to agents of
    runs that ended (the agent exits with its tracker) are dropped here, so a worker that serves
    query after query keeps none of them."""
    for ended in [k for k, c in _AGENTS.items() if c.closed]:
        del _AGENTS[ended]
    return _AGENTS.get(tracker_id)


def _connect_agent(partition, opts: ShareSourceOptions):
    """Find or start this executor's agent; the connection is kept for this worker's next tasks."""
    from .launcher import ensure_agent

    conn = _AGENTS[partition.tracker_id] = ensure_agent(
        (partition.tracker_host, partition.tracker_port), partition.tracker_id, partition.secret, opts)
    return conn
