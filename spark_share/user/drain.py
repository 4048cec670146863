"""``spark_share.drain(writer)``: a scheduled drain that reads what the queue holds and stops, on every
supported Spark.

Spark >= 4.2 runs ``Trigger.AvailableNow`` of a Python source to the end, and ``drain`` is only that
trigger. Spark 4.0 and 4.1 run it as one batch (a batch holds at most the group's lock budget, so a
bigger queue would end half read): there ``drain`` starts the query with the default trigger and marks
it in the session's conf (``spark_share.drain.<query id>``); the commit listener that ``register()``
installed (in the user's process, or on the Spark Connect server) sees the mark after each batch, tells
the query's tracker to run as AvailableNow does (towards what was queued when the run started), and
stops the query once the tracker says that is read and acknowledged.

Owns: choosing the trigger of a drain, the mark, and what the listener does for a marked query.
Must never: stop a query before its tracker said the drain is done and every batch is acknowledged.
"""
from __future__ import annotations

import logging
import threading

from .. import spark_versions
from ..transport.protocol import Drain, call
from . import client

log = logging.getLogger("spark_share.user.drain")

MARK = "spark_share.drain."  # + the query id: a conf of the session that started the query
IDLE_EVENTS = "spark.sql.streaming.noDataProgressEventInterval"
IDLE_EVENT_MS = 1000


def drain(writer):
    if spark_versions.NATIVE_AVAILABLE_NOW:
        return writer.trigger(availableNow=True).start()
    spark = getattr(writer, "_spark", None) or writer._session  # the writer's session: classic, or Connect
    # An idle query reports to the listener every IDLE_EVENT_MS instead of Spark's 10 s: a drain of a
    # queue that goes quiet ends that much sooner. Spark reads the interval when the query starts.
    before = spark.conf.get(IDLE_EVENTS, None)
    spark.conf.set(IDLE_EVENTS, f"{IDLE_EVENT_MS}ms")
    try:
        q = writer.trigger(processingTime="0 seconds").start()
    finally:
        if before is None:
            spark.conf.unset(IDLE_EVENTS)
        else:
            spark.conf.set(IDLE_EVENTS, before)
    try:
        spark.conf.set(MARK + str(q.id), "true")
    except BaseException:
        q.stop()
        raise
    return q


def marked(spark, query_id: str) -> bool:
    try:
        return spark is not None and spark.conf.get(MARK + query_id, None) == "true"
    except Exception:  # the session is gone
        return False


def drive(spark, query_id: str) -> None:
    """After a batch (or an idle spell) of a marked query: make its tracker drain, and stop the query
    once the drain is done. Runs in the listener: the stop goes to a thread of its own."""
    # A tracker sandboxed apart from this process is reached through its mailbox, which the offset names.
    conn = client.tracker_for(query_id) or client.mailbox_of(spark.streams.get(query_id))
    if conn is None:
        return
    rep, _ = call(conn, Drain(query_id=query_id), timeout=30)
    if not rep.get("drained"):
        return
    log.info("query %s drained what was queued at its start; stopping it", query_id)
    spark.conf.unset(MARK + query_id)
    threading.Thread(target=_stop, args=(spark, query_id), name="spark-share-drain-stop", daemon=True).start()


def _stop(spark, query_id: str) -> None:
    q = spark.streams.get(query_id)
    if q is not None:
        q.stop()
