"""The StreamingQueryListener spark-share installs: in the user's process (classic), or on the
Spark Connect server (a Connect client may run on another machine).

Owns: noting a query's checkpoint location and trigger when it starts (so a stop can tell a
committed batch from one that was not, and a trigger this Spark cannot run is refused), telling the
tracker promptly that Spark committed a batch (so the acknowledgements of a long processingTime
trigger do not wait for the next one), and dropping the tracker connection when the query terminates.

Must never: break or slow the query (every failure here is logged at DEBUG and ignored), or
acknowledge anything itself.
"""
from __future__ import annotations

import logging
import warnings

from pyspark.sql.streaming import StreamingQueryListener

from .. import connect, runtime, spark_versions
from ..offsets import reported
from ..transport.protocol import Committed, call_async
from . import client, drain

log = logging.getLogger("spark_share.user.listener")


_installed: set[int] = set()


def _note_start(spark, query_id: str, run_id: str) -> None:
    """Tell this host's tracker of the query, as the query starts (the listener is called
    synchronously with start()), where its commit log is and what its trigger is. With the commit log,
    a stop ACCEPTs a batch Spark committed a moment before rather than releasing it, even when no
    signal came after the commit (a Trigger.Once run ends right after its only batch); with the
    trigger, a Trigger.AvailableNow run that this Spark would end after one batch is refused."""
    try:
        execution = spark.streams.get(query_id)._jsq.streamingQuery()
    except Exception:  # not readable through this JVM
        return
    note = {"runId": run_id}
    try:
        note["root"] = str(execution.resolvedCheckpointRoot())
    except Exception:
        pass
    try:
        note["trigger"] = str(execution.trigger().getClass().getName())
    except Exception:
        pass
    runtime.write_private_json(runtime.checkpoint_note_path(query_id), note)


def _forget_checkpoint(query_id: str, run_id: str) -> None:
    path = runtime.checkpoint_note_path(query_id)
    note = runtime.read_json(path)
    if note is not None and note.get("runId") == run_id:  # else a restart of the query noted its own run
        runtime.remove(path)


def _signal_commit(progress) -> None:
    """Spark posts a progress event once the batch is in its commit log: tell the tracker that planned
    the batch (the run in our source's ``endOffset``) how far it may acknowledge, exactly (our batch id
    is in it too), with the query id, which a tracker whose reads did not carry it (under Spark Connect)
    learns here."""
    ends = [(upto, run) for upto, run, _ in filter(None, (reported(s.endOffset) for s in progress.sources)) if run]
    if not ends:
        return
    upto, run = ends[0]
    conn = client.tracker_by_id(str(run), query_id=str(progress.id))
    if conn is not None:
        call_async(conn, Committed(int(progress.batchId), source_batch=upto, query_id=str(progress.id)))


class ServerCommitListener(StreamingQueryListener):
    """The listener a Spark Connect server runs for a client session, in a Python process on the
    driver host (next to the trackers). Importable by reference: nothing of the client is captured.
    Its session (``self.spark``, the client's) carries the marks of ``spark_share.drain()``."""

    def _session(self):
        return getattr(self, "spark", None)

    def onQueryStarted(self, event):
        pass

    def onQueryProgress(self, event):
        try:
            _signal_commit(event.progress)
        except Exception:  # a listener must never break the query
            log.debug("commit signal failed", exc_info=True)
        self._drain(str(event.progress.id))

    def onQueryIdle(self, event):
        self._drain(str(event.id))

    def _drain(self, query_id: str) -> None:
        if spark_versions.NATIVE_AVAILABLE_NOW:  # drain() is Trigger.AvailableNow there: nothing is marked
            return
        try:
            spark = self._session()
            if drain.marked(spark, query_id):
                drain.drive(spark, query_id)
        except Exception:  # a listener must never break the query
            log.debug("driving the drain failed", exc_info=True)

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
        the note of the query's start."""

        def _session(self):
            return spark

        def onQueryStarted(self, event):
            try:
                _note_start(spark, str(event.id), str(event.runId))
            except Exception:  # a listener must never break the query
                log.debug("noting the query's start failed", exc_info=True)

        def onQueryTerminated(self, event):
            super().onQueryTerminated(event)
            _forget_checkpoint(str(event.id), str(event.runId))

    key = id(spark)
    if key in _installed:
        return
    spark.streams.addListener(CommitListener())
    _installed.add(key)
