"""Per-row verdicts and commit signals, from the user's process to the tracker.

Owns: ``reject`` / ``release`` (called in foreachBatch; they send the rows' coordinates to the
tracker of this query and batch), the StreamingQueryListener that tells the tracker a batch has
committed (so acknowledgements do not wait for the next trigger), and ``status``.

Must never: acknowledge anything itself (verdicts apply only when the batch commits, through the
consumer that acquired the record), or act on a batch other than the one running.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

from . import wire
from .agent import checkpoint_note_path, runtime_dir

log = logging.getLogger("spark_share.verdicts")

COORDINATES = ("topic", "partition", "offset")


class VerdictError(RuntimeError):
    """reject()/release() could not be applied; nothing of the batch is acknowledged wrongly."""


_conns: Dict[str, wire.RpcConnection] = {}
_conns_lock = threading.Lock()


def _registry(query_id: str) -> Optional[dict]:
    path = os.path.join(runtime_dir(), f"query-{query_id}.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def tracker_for(query_id: str) -> Optional[wire.RpcConnection]:
    """The authenticated connection to the tracker of a running kafka-share query on this host."""
    with _conns_lock:
        conn = _conns.get(query_id)
        if conn is not None and not conn.closed:
            return conn
        reg = _registry(query_id)
        if reg is None:
            return None
        try:
            conn = wire.connect((reg["host"], reg["port"]), reg["secret"], name="verdicts")
        except OSError:
            return None
        _conns[query_id] = conn
        return conn


def _current_batch(spark) -> Tuple[str, int]:
    sc = spark.sparkContext
    qid = sc.getLocalProperty("sql.streaming.queryId")
    bid = sc.getLocalProperty("streaming.sql.batchId")
    if not qid or bid is None:
        raise VerdictError("spark_share.reject()/release() must be called inside foreachBatch of a kafka-share query")
    return qid, int(bid)


def _coordinates(rows) -> Tuple[object, List[Tuple[str, int, int]]]:
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


def _send(kind: str, rows, reason: Optional[str]) -> int:
    from pyspark.sql import SparkSession

    spark, coords = _coordinates(rows)
    spark = spark or SparkSession.getActiveSession()
    if spark is None:
        raise VerdictError("no active Spark session")
    qid, batch = _current_batch(spark)
    if not coords:
        return 0
    conn = tracker_for(qid)
    if conn is None:
        raise VerdictError(f"query {qid} is not a running kafka-share query on this host")
    try:
        conn.call({"op": "verdicts", "spark_batch": batch, "kind": kind, "reason": reason,
                   "records": [list(c) for c in coords]}, timeout=60)
    except wire.RemoteError as e:
        raise VerdictError(f"spark_share.{kind}(): {str(e).split(': ', 1)[-1]}") from None
    return len(coords)


def reject(rows, reason: Optional[str] = None) -> int:
    """REJECT these rows once the batch commits: the broker archives them, never redelivers."""
    return _send("reject", rows, reason)


def release(rows) -> int:
    """RELEASE these rows once the batch commits: they are delivered again (deliveryCount + 1)."""
    return _send("release", rows, None)


def status(query) -> dict:
    conn = tracker_for(str(query.id))
    if conn is None:
        raise VerdictError(f"query {query.id} is not a running kafka-share query on this host")
    rep, _ = conn.call({"op": "status"}, timeout=30)
    return rep


# ---------------------------------------------------------------------------------------------
# Commit signal

_installed = set()


def _checkpoint_root(spark, query_id: str) -> Optional[str]:
    """The query's resolved checkpoint location, from the JVM (None when it cannot be read)."""
    try:
        return str(spark.streams.get(query_id)._jsq.streamingQuery().resolvedCheckpointRoot())
    except Exception:
        return None


def _note_checkpoint(spark, query_id: str, run_id: str) -> None:
    """Tell this host's tracker of the query where its commit log is, as the query starts (the
    listener is called synchronously with start()): at a stop, a batch Spark committed a moment
    before is then ACCEPTed rather than released, even when no signal came after the commit (a
    Trigger.Once run ends right after its only batch)."""
    root = _checkpoint_root(spark, query_id)
    if not root:
        return
    path = checkpoint_note_path(query_id)
    fd = os.open(path + ".tmp", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"root": root, "runId": run_id}, f)
    os.replace(path + ".tmp", path)


def _forget_checkpoint(query_id: str, run_id: str) -> None:
    path = checkpoint_note_path(query_id)
    try:
        with open(path) as f:
            if json.load(f).get("runId") != run_id:
                return  # a restart of the query noted its own run already
        os.unlink(path)
    except (OSError, ValueError):
        pass


def install_listener(spark) -> None:
    from pyspark.sql.streaming import StreamingQueryListener

    class CommitListener(StreamingQueryListener):
        """Progress events are posted after the batch is in the commit log: acknowledge it now."""

        def onQueryStarted(self, event):
            try:
                _note_checkpoint(spark, str(event.id), str(event.runId))
            except Exception:  # a listener must never break the query
                log.debug("noting the checkpoint failed", exc_info=True)

        def onQueryProgress(self, event):
            p = event.progress
            try:
                conn = tracker_for(str(p.id))
                if conn is not None:
                    conn.call_async({"op": "committed", "spark_batch": int(p.batchId)})
            except Exception:  # a listener must never break the query
                log.debug("commit signal failed", exc_info=True)

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            with _conns_lock:
                conn = _conns.pop(str(event.id), None)
            if conn is not None:
                conn.close()
            _forget_checkpoint(str(event.id), str(event.runId))

    key = id(spark)
    if key in _installed:
        return
    spark.streams.addListener(CommitListener())
    _installed.add(key)
