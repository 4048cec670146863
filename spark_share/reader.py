"""The streaming reader of ``format("kafka-share")``: Spark's calls, mapped onto the tracker and agents.

Owns: the driver-side calls (latestOffset acknowledges
the batch Spark has just committed, then decides whether a new one is worth running), the input
partitions, and ``read()``, which hands the (batch, slot) to the executor side (``executor.read_task``),
or under ``readMode=driver`` decodes the rows the partition carries (``driver.reads``).

Must never: hold a Kafka consumer in ``read()`` (Python workers come and go), create sockets,
threads or clients before a driver-only method runs (the reader is pickled to executors), or
return from ``latestOffset`` with a new batch before the previous one's acknowledgements are queued
on the consumers that hold its records.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from pyspark.sql.datasource import DataSourceStreamReader

from . import runtime
from .consumers import records
from .driver.batches import PLANNED
from .errors import SourceError
from .executor import read_task
from .offsets import INITIAL, batch_of, offset_of, pending_of, records_of
from .options import ShareSourceOptions, scrub
from .partitions import RowsPartition, SharePartition
from .spark_versions import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow, max_rows

log = logging.getLogger("spark_share.reader")



def _start_agent_early(t) -> None:
    from .executor.launcher import ensure_agent

    try:
        ensure_agent(t.address, t.tracker_id, t.secret, t.opts).close()
    except Exception as e:  # the first read task starts it then, and reports what fails
        log.info("starting this executor's spark-share agent ahead of the first read failed: %s",
                 scrub(str(e), t.opts.secret_values()))


class ShareStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts: ShareSourceOptions):
        self.opts = opts
        self._tracker = None
        self._driver_reads = None  # readMode=driver: the consumers in this process
        self._stopped = False
        # The end of the last batch Spark planned (partitions()): where the next batch starts when
        # Spark does not say (latestOffset() of Spark < 4.2). A restart first calls partitions(end, end)
        # with the last offset of the checkpoint; a fresh start calls latestOffset() before anything.
        self._planned_end: dict | None = None
        self._committed_noted: int | None = None  # the last committed batch of an earlier run whose records we know

    # driver side (the runner process) ------------------------------------------------------
    def _t(self):
        if self._tracker is None:
            if self._stopped:
                raise SourceError("the kafka-share source is stopping")
            from .driver.tracker import Tracker, one_host

            runtime.log_to_stderr()
            if threading.current_thread() is threading.main_thread() and _in_source_runner():
                # The JVM ends the runner with SIGTERM on stop and failure: stop() then runs on a thread
                # of its own, and the process exits when it is done.
                _StopOnSigterm(self)
            self._tracker = Tracker(self.opts)
            if self.opts.read_mode == "driver":
                from .driver.reads import DriverReads

                self._driver_reads = DriverReads(self._tracker, self.opts)
            elif one_host():
                # Every read task runs on this host: start its agent now, so that its consumers join
                # the group while Spark plans the first batch, not after the first read task arrives.
                threading.Thread(target=_start_agent_early, args=(self._tracker,), name="spark-share-agent-start",
                                 daemon=True).start()
        return self._tracker

    def initialOffset(self) -> dict:
        self._t()  # fail fast on an unreachable broker or a missing topic
        return offset_of(INITIAL)

    def getDefaultReadLimit(self):
        n = self.opts.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._t().prepare_available_now()

    def latestOffset(self, start: dict | None = None, limit=None) -> dict:
        t = self._t()
        if start is None:  # Spark < 4.2 passes neither: the end of the last planned batch, and our own limit
            start = self._planned_end if self._planned_end is not None else offset_of(INITIAL)
            limit = self.getDefaultReadLimit()
        last = batch_of(start)
        # Spark calls latestOffset only once every batch it planned is in the commit log (also the calls
        # of Spark's AvailableNow wrapper and its progress report): the batch ending at start is.
        # Its acknowledgements are queued on the consumers before this returns; the broker's answers
        # are collected while Spark writes the next offsets and plans.
        self._note_committed(start)
        t.batch_committed(last, wait=False)
        if not t.should_run(last):
            return start
        b = t.plan(last + 1, max_rows(limit))
        if b is None:
            return start
        acquired = None
        if self._driver_reads is not None and b.state == PLANNED:
            # readMode=driver acquires the batch here, so that the offset Spark writes next names its records:
            # a replay of this batch id gets them again.
            acquired = self._driver_reads.acquire(t, b)
        pending = self._driver_reads.pending(t) if self._driver_reads is not None else None
        return offset_of(last + 1, t.tracker_id, self.opts.exchange_location, acquired, pending)

    def _note_committed(self, offset: dict) -> None:
        """``offset`` ends a batch Spark committed: if an earlier run planned it (readMode=driver), its records
        may be unacknowledged; they are ACCEPTed when the broker delivers them again, never emitted."""
        if (self._driver_reads is None or offset.get("run") in (None, self._tracker.tracker_id)
                or self._committed_noted == batch_of(offset)):
            return
        if self._tracker.released_after_commit(offset.get("run"), batch_of(offset)):
            log.warning("spark-share batch %d was committed by Spark but given back by the run that read it (its dead "
                        "letters could not be written): its records are processed again", batch_of(offset))
            return
        if batch_of(offset) in self._tracker.batches:
            # This run read it again: it acknowledges what the replay carried itself, and what the replay did not
            # get (another member had it) was never written: it must reach a later batch if it comes back.
            return
        self._committed_noted = batch_of(offset)
        committed = records_of(offset)
        if committed:
            self._driver_reads.committed(committed)
        pending = pending_of(offset)  # earlier batches' records that had not come back to that run
        if pending is not None:
            self._driver_reads.committed(pending[1], since=pending[0])

    def reportLatestOffset(self):
        return self._tracker.progress() if self._tracker is not None else None

    def partitions(self, start: dict, end: dict):
        t = self._t()
        first, last = batch_of(start), batch_of(end)
        self._planned_end = end
        if last <= first:
            # A restart's first call on Spark < 4.2 names the offset log's last batch, committed or not (4.1.4
            # measured: partitions(end, end), then partitions(before, end) to run it again): the latestOffset()
            # that follows a committed one notes it.
            return []
        self._note_committed(start)
        wanted = records_of(end) if self._driver_reads is not None and last not in t.batches else None
        if wanted is not None:  # a batch an earlier run planned: the same records again
            return self._driver_reads.replay(t, last, wanted, end.get("run"))
        b = t.batch_to_read(last)
        if b is None:  # replayed from an earlier run without its records (readMode=executors), or stopping
            return []
        if self._driver_reads is not None:
            return self._driver_reads.partitions(t, b)
        host, port = t.address
        return [SharePartition(host, port, t.tracker_id, t.secret, last, slot, budget, self.opts.poll_timeout_ms)
                for slot, budget in enumerate(t.slot_budgets(b))]

    def commit(self, end: dict) -> None:
        # One batch late and never for the last batch: only a backstop for latestOffset.
        if self._tracker is not None:
            self._tracker.batch_committed(batch_of(end))

    def stop(self) -> None:
        self._stopped = True
        if self._tracker is not None:
            self._tracker.shutdown()  # a second caller waits for the first
        if self._driver_reads is not None:
            self._driver_reads.close()

    def read(self, partition: SharePartition | RowsPartition) -> Iterator:  # type: ignore[override]
        if isinstance(partition, RowsPartition):  # readMode=driver: the rows came in the task
            yield from records.from_ipc(partition.ipc)
            return
        yield from read_task.read(partition, self.opts)  # executor side: this executor's agent serves it


class _StopOnSigterm:
    """SIGTERM (q.stop(), a query failure, a restart) wakes one thread that runs the reader's stop()
    and then ends the process: the main thread is never interrupted in the middle of a call (an
    exception raised wherever it happened to be left batches half acknowledged and stop() waiting
    for them). The kernel may deliver the signal to any thread while the main one blocks on the
    JVM's socket, so the wake-up is the byte the C-level handler writes to ``set_wakeup_fd``, not
    the Python-level handler (which runs only once the main thread comes back to Python)."""

    def __init__(self, reader: ShareStreamReader):
        self._reader = reader
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # replaces the default: terminate
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        threading.Thread(target=self._run, args=(wake_r,), name="spark-share-stop", daemon=True).start()

    def _run(self, wake_r: int) -> None:
        while signal.SIGTERM not in os.read(wake_r, 64):  # other signals with Python handlers write here too
            pass
        code = 128 + signal.SIGTERM
        try:
            self._reader.stop()
        except BaseException:
            log.exception("spark-share: stopping after SIGTERM failed")
            code = 1
        finally:
            logging.shutdown()
            os._exit(code)


def _in_source_runner() -> bool:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.endswith("python_streaming_source_runner") or os.environ.get("SPARK_SHARE_FORCE_SIGTERM") == "1"
