"""Per-row verdicts, from the user's process to the tracker of the running batch.

Owns: ``reject`` / ``release`` (called in foreachBatch; they send the rows' coordinates to the
tracker of this query and batch: through this host's runtime directory, or through the source's
``exchangeLocation``, which the batch's DataFrame names in its schema on Spark >= 4.2 and the caller
names otherwise) and their bad-input errors.

Must never: acknowledge anything itself (verdicts apply only when the batch commits, through the
consumer that acquired the record), or act on a batch other than the one running.
"""
from __future__ import annotations

import logging
import uuid

from .. import connect, verdict_set
from ..acknowledgement import REJECT, RELEASE
from ..errors import VerdictError
from ..options import EXCHANGE_METADATA
from ..transport.protocol import Verdicts, call
from .client import tracker_for, trackers_reachable

log = logging.getLogger("spark_share.user.verdicts")

COORDINATES = ("topic", "partition", "offset")


def _current_batch(spark) -> tuple[str, int]:
    sc = spark.sparkContext
    qid = sc.getLocalProperty("sql.streaming.queryId")
    bid = sc.getLocalProperty("streaming.sql.batchId")
    if not qid or bid is None:
        raise VerdictError("spark_share.reject()/release() must be called inside foreachBatch of a kafka-share query")
    return qid, int(bid)


def _exchange_location(rows) -> str | None:
    """The source's ``exchangeLocation``, as the batch DataFrame's offset column carries it (``source.schema``)."""
    return rows.schema["offset"].metadata.get(EXCHANGE_METADATA)


def _coordinates(rows):
    """(spark session or None, the rows' (topic, partition, offset) as an Arrow table, the source's
    exchangeLocation or None) of a DataFrame or a list of Rows. A DataFrame's come to this process as Arrow
    (``toArrow``), never a Python object per row: two million rejects are a table of a few tens of MB."""
    import pyarrow as pa
    from pyspark.sql import DataFrame

    if isinstance(rows, DataFrame):
        missing = [c for c in COORDINATES if c not in rows.columns]
        if missing:
            raise VerdictError(f"rows passed to reject()/release() lack the column(s) {missing}; keep the "
                               "source's topic, partition and offset columns in the DataFrame")
        chosen = rows.select(*COORDINATES)
        return rows.sparkSession, chosen.toArrow().cast(verdict_set.COORDINATES), _exchange_location(chosen)
    out = []
    for r in rows:
        try:
            out.append((r["topic"], int(r["partition"]), int(r["offset"])))
        except (KeyError, ValueError, TypeError, IndexError):
            raise VerdictError(f"row {r!r} lacks the topic, partition and offset fields of the source") from None
    return None, pa.table({"topic": pa.array([t for t, _, _ in out], pa.string()),
                           "partition": pa.array([p for _, p, _ in out], pa.int32()),
                           "offset": pa.array([o for _, _, o in out], pa.int64())}), None


def _send(kind: str, rows, reason: str | None, exchange_location: str | None) -> int:
    from pyspark.sql import SparkSession

    if exchange_location is not None and not str(exchange_location).startswith("/"):
        raise VerdictError(f"spark_share.{kind}(): exchange_location={exchange_location!r} must be the absolute "
                           "directory path given to the source as its option exchangeLocation")
    spark, coords, exchange = _coordinates(rows)
    exchange = exchange_location or exchange
    spark = spark or SparkSession.getActiveSession() or connect.active_session()
    if spark is None:
        raise VerdictError("no active Spark session")
    if connect.is_connect(spark):
        return _send_connect(spark, kind, coords, reason, exchange)
    qid, batch = _current_batch(spark)
    if not coords.num_rows:
        return 0
    conn = tracker_for(qid)
    if conn is not None:
        return _call(conn, kind, coords, reason, Verdicts(batch, kind, uuid.uuid4().hex, reason=reason))["records"]
    # No tracker registered this query on this host (readMode=driver: no read task told it which query it
    # serves; or the source runs where this process sees nothing of it): the one whose running batch holds
    # these rows.
    for conn in trackers_reachable(exchange):
        rep = _call(conn, kind, coords, reason, Verdicts(batch, kind, uuid.uuid4().hex, reason=reason, query_id=qid))
        if rep.get("match"):
            return rep["records"]
    raise VerdictError(f"query {qid} is not a running kafka-share query on this host, or these rows are not from "
                       f"the batch it is processing (pass rows of the DataFrame foreachBatch was given){_unreached(exchange)}")


def _unreached(exchange: str | None) -> str:
    if exchange is None:
        return ("; where the platform runs this code apart from the source's process (a sandbox that shares "
                "neither its /tmp nor its ports), give the source the option exchangeLocation: a directory both "
                "see (on Spark < 4.2, or with rows collected to a list, name it here too: exchange_location=)")
    return f"; no running tracker answered in its exchangeLocation {exchange!r}"


def _send_connect(spark, kind: str, coords, reason: str | None, exchange: str | None) -> int:
    """Under Spark Connect, foreachBatch runs in a process of the server's, on the driver host, and
    sees no query or batch id: the batch is the one this Connect session's jobs are reading, and
    the tracker is whichever one on this host has such a batch."""
    if not connect.in_foreach_batch_worker():
        raise VerdictError("spark_share.reject()/release() must be called inside foreachBatch of a kafka-share "
                           "query (under Spark Connect, in the function given to foreachBatch, which the server runs)")
    if not coords.num_rows:
        return 0
    for conn in trackers_reachable(exchange):
        msg = Verdicts(None, kind, uuid.uuid4().hex, reason=reason, connect_session=spark.session_id)
        rep = _call(conn, kind, coords, reason, msg)
        if rep.get("match"):
            return rep["records"]
    raise VerdictError(f"spark_share.{kind}(): these rows are not from the batch being processed by a running "
                       "kafka-share query on this host (pass rows of the DataFrame foreachBatch was given, "
                       "and run the query's source and its foreachBatch with one runtime directory, "
                       f"SPARK_SHARE_RUNTIME_DIR){_unreached(exchange)}")


def _call(conn, kind: str, coords, reason: str | None, msg: Verdicts) -> dict:
    """Send the rows in chunks (each a small frame); the tracker applies them at the last, all or none.
    A tracker that does not read the batch answers the first chunk ``match: False``."""
    chunks = verdict_set.VerdictSet.of(coords, {"reject": REJECT, "release": RELEASE}[kind], reason).chunks()
    msg.parts = len(chunks)
    rep: dict = {}
    try:
        for part, chunk in enumerate(chunks):
            msg.part = part
            rep, _ = call(conn, msg, timeout=120, blob=chunk)
            if not rep.get("match", True):
                return rep
    except VerdictError as e:  # the tracker refused them; the error crossed the socket by class
        raise VerdictError(f"spark_share.{kind}(): {e}") from None
    return rep


def reject(rows, reason: str | None = None, exchange_location: str | None = None) -> int:
    """REJECT these rows once the batch commits: the broker archives them, never redelivers."""
    return _send("reject", rows, reason, exchange_location)


def release(rows, exchange_location: str | None = None) -> int:
    """RELEASE these rows once the batch commits: they are delivered again (deliveryCount + 1)."""
    return _send("release", rows, None, exchange_location)
