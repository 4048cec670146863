"""The StreamingQueryListener spark-share installs: in the user's process (classic), or on the
Spark Connect server (a Connect client may run on another machine).

Owns: noting a query's checkpoint location when it starts (so a stop can tell a committed batch
from one that was not), telling the tracker promptly that Spark committed a batch (so the
acknowledgements of a long processingTime trigger do not wait for the next one), and dropping the
tracker connection when the query terminates.

Must never: break or slow the query (every failure here is logged at DEBUG and ignored), or
acknowledge anything itself.
"""
from __future__ import annotations

import json
import logging
import warnings

from pyspark.sql.streaming import StreamingQueryListener

from .. import connect, runtime
from ..offsets import batch_of
from ..transport.protocol import Committed, call_async
from . import client

log = logging.getLogger("spark_share.user.listener")


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


def _signal_commit(progress) -> None:
    """Spark posts a progress event once the batch is in its commit log: tell the tracker that
    reported in this batch's progress (its id is in our source's ``latestOffset``) how far it may
    acknowledge, exactly (our batch id is the source's ``endOffset``)."""
    reported = client.kafka_share_progress(progress)
    if reported is None:
        return
    conn = client.tracker_by_id(reported["tracker"], query_id=str(progress.id))
    if conn is None:
        return
    ends = [s.endOffset for s in progress.sources if s.latestOffset and reported["tracker"] in s.latestOffset]
    call_async(conn, Committed(int(progress.batchId), source_batch=batch_of(json.loads(ends[0])),
                               query_id=str(progress.id)))


class ServerCommitListener(StreamingQueryListener):
    """The listener a Spark Connect server runs for a client session, in a Python process on the
    driver host (next to the trackers). Importable by reference: nothing of the client is captured."""

    def onQueryStarted(self, event):
        pass

    def onQueryProgress(self, event):
        try:
            _signal_commit(event.progress)
        except Exception:  # a listener must never break the query
            log.debug("commit signal failed", exc_info=True)

    def onQueryIdle(self, event):
        pass

    def onQueryTerminated(self, event):
        client.forget(str(event.id))


NO_SERVER_LISTENER = ("spark-share: this Spark Connect server refused a server-side query listener, so records are "
                      "acknowledged when the next batch is planned, not as soon as a batch commits; keep the trigger "
                      "interval well below the share group's record lock duration (or use a classic session)")


def install_listener(spark) -> None:
    if connect.is_connect(spark):
        if not connect.install_server_listener(spark, ServerCommitListener()):
            warnings.warn(NO_SERVER_LISTENER, stacklevel=3)
            log.warning(NO_SERVER_LISTENER)
        return

    class CommitListener(ServerCommitListener):
        """In a classic session: the same signals from the user's process, which is the driver, plus
        the checkpoint note."""

        def onQueryStarted(self, event):
            try:
                _note_checkpoint(spark, str(event.id), str(event.runId))
            except Exception:  # a listener must never break the query
                log.debug("noting the checkpoint failed", exc_info=True)

        def onQueryTerminated(self, event):
            super().onQueryTerminated(event)
            _forget_checkpoint(str(event.id), str(event.runId))

    key = id(spark)
    if key in _installed:
        return
    spark.streams.addListener(CommitListener())
    _installed.add(key)
