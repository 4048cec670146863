"""Per-row verdicts, from the user's process to the tracker of the running batch.

Owns: ``reject`` / ``release`` (called in foreachBatch; they send the rows' coordinates to the
tracker of this query and batch) and their bad-input errors.

Must never: acknowledge anything itself (verdicts apply only when the batch commits, through the
consumer that acquired the record), or act on a batch other than the one running.
"""
from __future__ import annotations

import logging

from .. import connect
from ..errors import VerdictError
from ..transport.protocol import Verdicts, call
from .client import tracker_for, trackers_on_this_host

log = logging.getLogger("spark_share.user.verdicts")

COORDINATES = ("topic", "partition", "offset")


def _current_batch(spark) -> tuple[str, int]:
    sc = spark.sparkContext
    qid = sc.getLocalProperty("sql.streaming.queryId")
    bid = sc.getLocalProperty("streaming.sql.batchId")
    if not qid or bid is None:
        raise VerdictError("spark_share.reject()/release() must be called inside foreachBatch of a kafka-share query")
    return qid, int(bid)


def _coordinates(rows) -> tuple[object, list[tuple[str, int, int]]]:
    """(spark session or None, [(topic, partition, offset)]) of a DataFrame or a list of Rows."""
    from pyspark.sql import DataFrame

    if isinstance(rows, DataFrame):
        missing = [c for c in COORDINATES if c not in rows.columns]
        if missing:
            raise VerdictError(f"rows passed to reject()/release() lack the column(s) {missing}; keep the "
                               "source's topic, partition and offset columns in the DataFrame")
        coords = [(r[0], int(r[1]), int(r[2])) for r in rows.select(*COORDINATES).collect()]
        return rows.sparkSession, coords
    out = []
    for r in rows:
        try:
            out.append((r["topic"], int(r["partition"]), int(r["offset"])))
        except (KeyError, ValueError, TypeError, IndexError):
            raise VerdictError(f"row {r!r} lacks the topic, partition and offset fields of the source") from None
    return None, out


def _send(kind: str, rows, reason: str | None) -> int:
    from pyspark.sql import SparkSession

    spark, coords = _coordinates(rows)
    spark = spark or SparkSession.getActiveSession() or connect.active_session()
    if spark is None:
        raise VerdictError("no active Spark session")
    if connect.is_connect(spark):
        return _send_connect(spark, kind, coords, reason)
    qid, batch = _current_batch(spark)
    if not coords:
        return 0
    conn = tracker_for(qid)
    if conn is None:
        raise VerdictError(f"query {qid} is not a running kafka-share query on this host")
    _call(conn, kind, Verdicts(batch, kind, [list(c) for c in coords], reason))
    return len(coords)


def _send_connect(spark, kind: str, coords: list, reason: str | None) -> int:
    """Under Spark Connect, foreachBatch runs in a process of the server's, on the driver host, and
    sees no query or batch id: the batch is the one this Connect session's jobs are reading, and
    the tracker is whichever one on this host has such a batch."""
    if not connect.in_foreach_batch_worker():
        raise VerdictError("spark_share.reject()/release() must be called inside foreachBatch of a kafka-share "
                           "query (under Spark Connect, in the function given to foreachBatch, which the server runs)")
    if not coords:
        return 0
    msg = Verdicts(None, kind, [list(c) for c in coords], reason, connect_session=spark.session_id)
    for conn in trackers_on_this_host():
        if _call(conn, kind, msg).get("match"):
            return len(coords)
    raise VerdictError(f"spark_share.{kind}(): these rows are not from the batch being processed by a running "
                       "kafka-share query on this host (pass rows of the DataFrame foreachBatch was given, "
                       f"and run the query's source and its foreachBatch with one runtime directory, "
                       "SPARK_SHARE_RUNTIME_DIR)")


def _call(conn, kind: str, msg: Verdicts) -> dict:
    try:
        rep, _ = call(conn, msg, timeout=60)
    except VerdictError as e:  # the tracker refused them; the error crossed the socket by class
        raise VerdictError(f"spark_share.{kind}(): {e}") from None
    return rep


def reject(rows, reason: str | None = None) -> int:
    """REJECT these rows once the batch commits: the broker archives them, never redelivers."""
    return _send("reject", rows, reason)


def release(rows) -> int:
    """RELEASE these rows once the batch commits: they are delivered again (deliveryCount + 1)."""
    return _send("release", rows, None)
