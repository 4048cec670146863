"""The StreamingQueryListener spark-share installs in the user's process.

Owns: noting a query's checkpoint location when it starts (so a stop can tell a committed batch
from one that was not), telling the tracker promptly that Spark committed a batch (so the
acknowledgements of a long processingTime trigger do not wait for the next one), and dropping the
tracker connection when the query terminates.

Must never: break or slow the query (every failure here is logged at DEBUG and ignored), or
acknowledge anything itself.
"""
from __future__ import annotations

import logging

from . import client, runtime
from .protocol import Committed, call_async

log = logging.getLogger("spark_share.listener")


_installed: set[int] = set()


def _checkpoint_root(spark, query_id: str) -> str | None:
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
    runtime.write_private_json(runtime.checkpoint_note_path(query_id), {"root": root, "runId": run_id})


def _forget_checkpoint(query_id: str, run_id: str) -> None:
    path = runtime.checkpoint_note_path(query_id)
    note = runtime.read_json(path)
    if note is not None and note.get("runId") == run_id:  # else a restart of the query noted its own run
        runtime.remove(path)


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
                conn = client.tracker_for(str(p.id))
                if conn is not None:
                    call_async(conn, Committed(int(p.batchId)))
            except Exception:  # a listener must never break the query
                log.debug("commit signal failed", exc_info=True)

        def onQueryIdle(self, event):
            pass

        def onQueryTerminated(self, event):
            client.forget(str(event.id))
            _forget_checkpoint(str(event.id), str(event.runId))

    key = id(spark)
    if key in _installed:
        return
    spark.streams.addListener(CommitListener())
    _installed.add(key)
