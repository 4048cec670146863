"""``readMode=driver``: the query run's share consumers in the source runner, beside the tracker; a batch's
records acquired at ``latestOffset`` (before Spark writes the offset that names them) and carried to the
read tasks inside their input partitions; a batch an earlier run planned, acquired again by the records its
offset names; records of a batch Spark committed, ACCEPTed when they come back and never handed out.

Owns: the in-process agent (the agent of executor hosts, without the socket read tasks use there: it
reaches the tracker over the tracker's own protocol, so claims, acquisitions, verdicts, dead letters,
acknowledgements and the stop take one path in both modes), the run's ``RecordSorter`` (its sessions sort
every poll by it), reading every slot of a planned or replayed batch at once, and cutting a slot's rows
into partitions that fit a task payload.

Must never: give executors anything to do but decode Arrow (no process, socket, file or variable of
ours on an executor host), or hand Spark a partition whose rows the tracker does not know of (a slot's
``Acquired`` reaches the tracker before ``partitions`` returns).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from ..consumers import records
from ..consumers.agent import CLOSE_WAIT_S, Agent
from ..options import ShareSourceOptions
from ..partitions import RowsPartition
from ..record_ranges import RecordRanges, RecordSorter

log = logging.getLogger("spark_share.driver.reads")

# A slot's rows are cut into partitions of at most this many bytes of Arrow IPC: every task's payload
# crosses Spark's RPC (spark.rpc.message.maxSize, 128 MiB by default) and sits in the driver's memory
# until the batch ends; Spark warns above 1 MiB per task, which a full poll of 100-byte records passes.
PARTITION_BYTES = 16 << 20
# Past the group's session timeout, a new member gets a lost one's partitions within a heartbeat (5 s by default).
REPLAY_JOIN_MS = 6000
# A replay's sessions wait this long at most for the broker to give them every partition the batch names
# (Kafka reassigns a group's partitions within a heartbeat: 5 s by default, 15 s at most).
ASSIGNMENT_WAIT_S = 15.0
EARLIER_STOP_WAIT_S = 45.0  # a stopping run's tracker ends within this (its bounded waits for the broker)


class DriverReads:
    """The consumers of a ``readMode=driver`` run and the reads of its batches, in the source runner."""

    def __init__(self, tracker, opts: ShareSourceOptions):
        self._opts = opts
        self._agent: Future = Future()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closing = threading.Event()  # set by close(): an agent still starting leaves, a replay's wait ends
        self._planned: dict[int, list[RowsPartition]] = {}  # acquired at latestOffset, until partitions() asks
        self._pending_told = 0  # how many pending records the log last named
        # Known before the agent starts: a replayed batch's polls may begin as its sessions join.
        self.sorter = tracker.sorter = tracker.acks.sorter = RecordSorter()
        # Started on a thread of its own: its consumers join the group while Spark writes the first offsets.
        threading.Thread(target=self._start, args=(tracker,), name="spark-share-driver-agent", daemon=True).start()

    def _start(self, tracker) -> None:
        opts = self._opts
        try:
            agent = Agent(tracker.address, tracker.tracker_id, tracker.secret, opts.consumer_config(),
                          opts.producer_config() if opts.dead_letter_topic else {}, opts.secret_values(), serve=False,
                          sorter=self.sorter)
        except BaseException as e:  # the first batch's planning raises it
            self._agent.set_exception(e)
            return
        with self._lock:
            self._agent.set_result(agent)
            closed = self._closing.is_set()
        if closed:  # the stop came while it started: close() did not see it, so it leaves now
            agent.shutdown()

    def acquire(self, tracker, b) -> RecordRanges:
        """Every slot of planned batch ``b`` read now (latestOffset: the offset Spark writes next names these
        records); what they acquired."""
        self._planned = {b.batch: self._read(b.batch, tracker.slot_budgets(b), self._opts.poll_timeout_ms)}
        return tracker.records_of(b)

    def partitions(self, tracker, b) -> list[RowsPartition]:
        """The partitions of batch ``b``: what ``acquire`` read, or (a batch planned before this Spark asked for
        its offset) its slots read now."""
        parts = self._planned.pop(b.batch, None)
        return parts if parts is not None else self._read(b.batch, tracker.slot_budgets(b), self._opts.poll_timeout_ms)

    def committed(self, ranges: RecordRanges, since: float | None = None) -> None:
        """Records of a batch Spark committed that an earlier run may not have acknowledged: ACCEPTed when the
        broker delivers them again, never handed out."""
        self.sorter.commit(ranges, since)

    def pending(self, tracker) -> tuple[float, RecordRanges] | None:
        """Those of them that have not come back, for the next batch's offset, until a lost run's members
        have left and its locks and ours have expired: by then they came back, or were acknowledged."""
        lock_ms = int(tracker.policy.lock_ms)
        pending = self.sorter.pending((max(tracker.session_ms or 0, lock_ms) + lock_ms + REPLAY_JOIN_MS) / 1000)
        if pending is not None and len(pending[1]) != self._pending_told:  # once per change, not per batch
            self._pending_told = len(pending[1])
            log.info("%d records of batches Spark committed before have not come back to this run: the next offset "
                     "names them, so a later run ACCEPTs them too (%s)", len(pending[1]), pending[1].described())
        return pending

    def replay(self, tracker, batch: int, wanted: RecordRanges, run: str | None = None) -> list[RowsPartition]:
        """Batch ``batch`` of an earlier run, read again: each slot's poll hands out only the records ``wanted``
        names (what else it acquires waits, still acquired, for the next batch); what did not come back is
        counted."""
        sorter = self.sorter
        # Before the ledger has the batch: nothing polls for it unsorted. Once some of its records came, the
        # rest are waited for half a lock at most: the ones held must not expire before Spark commits them.
        sorter.replay(batch, wanted, hold_s=tracker.policy.lock_ms / 2000)
        try:
            b = tracker.replay(batch, wanted)
            if b is None:  # stopping
                return []
            # A record that earlier run held comes back once its connection closed (both brokers release a
            # share session's records then) or its lock expired, to a member given its partition. A run that
            # was lost (not stopped) keeps its members, and their partitions, until the group's session
            # timeout: a poll before then fills its consumer with later records of the partitions it has and
            # may not poll again, so the replay waits that long first, and a record lock at least (the records
            # it held stay locked until then). Then the polls wait up to a record lock for the first of the
            # records the offset names, and half a lock more for the rest once some came.
            # A run of this host still stopping (Spark restarts a failed query at once) releases what it holds
            # in a moment: the replay waits for it.
            stopping_until = time.monotonic() + EARLIER_STOP_WAIT_S
            while tracker.earlier_run(run) == "running" and time.monotonic() < stopping_until:
                self._closing.wait(0.05)
            if tracker.earlier_run(run) != "closed":  # its members leave, and its records' locks expire
                gone_ms = max(tracker.session_ms or 0, int(tracker.policy.lock_ms)) + REPLAY_JOIN_MS
                log.info("batch %d: the run that planned it may have been lost with its consumers in the group; "
                         "the replay waits %.0f s for the group to drop them and for their locks to expire", batch,
                         gone_ms / 1000)
                self._closing.wait(gone_ms / 1000)
            wait_ms = max(self._opts.poll_timeout_ms, int(tracker.policy.lock_ms))
            pool = self._agent.result(timeout=120).pool
            # A fetch spends its record limit partition by partition, so a poll the size of the batch may fill
            # up with a partition's later records before it reaches the batch's other partitions; one the
            # size of the lock budget reaches each partition's locks, where the batch's records are.
            pool.fit(b.batch, max(len(wanted), tracker.policy.lock_budget))
            pool.await_assignment(wanted.runs, ASSIGNMENT_WAIT_S)
            parts = self._read(b.batch, tracker.slot_budgets(b), wait_ms, join=False)
        finally:
            sorter.replayed(batch)
        tracker.replayed(b, wanted)
        return parts

    def _read(self, batch: int, budgets: list[int | None], poll_timeout_ms: int,
              join: bool = True) -> list[RowsPartition]:
        """Every slot of ``batch`` read now, in parallel (a slot read before gets its cached rows), and cut
        into partitions (``join`` False: slots beyond the sessions there are read nothing)."""
        agent = self._agent.result(timeout=120)
        with self._lock:
            if self._pool is None:  # a run's slots only shrink (a group refusing members): the first count holds
                self._pool = ThreadPoolExecutor(max(len(budgets), 1), thread_name_prefix="spark-share-read")
            pool = self._pool
        reads = [pool.submit(agent.read_slot, batch, slot, budget, poll_timeout_ms, None, None, join=join)
                 for slot, budget in enumerate(budgets)]
        out: list[RowsPartition] = []
        for slot, f in enumerate(reads):
            _, ipc = f.result()
            out.extend(RowsPartition(batch, slot, i, piece) for i, piece in enumerate(_pieces(ipc)))
        return out

    def close(self) -> None:
        """After the tracker's stop (which shut the agent down through its connection): wait, bounded, for the
        consumers to close, then let the read threads go. An agent still starting shuts itself down."""
        with self._lock:
            self._closing.set()
        if self._agent.done() and self._agent.exception() is None:
            agent = self._agent.result()
            if not agent.done.wait(CLOSE_WAIT_S):
                agent.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _pieces(ipc) -> list:
    """A slot's Arrow IPC (a pyarrow Buffer, or bytes when another agent's rows were relayed), in pieces of at
    most PARTITION_BYTES (whole rows each): the slot itself if it fits, else its rows cut into zero-copy slices,
    each written once."""
    import pyarrow as pa

    ipc = ipc if isinstance(ipc, pa.Buffer) else pa.py_buffer(ipc)
    if ipc.size <= PARTITION_BYTES:
        return [ipc]
    table = pa.Table.from_batches(records.from_ipc(ipc))
    n = -(-ipc.size // PARTITION_BYTES)
    step = -(-table.num_rows // n)
    return [records.to_ipc(*table.slice(i, step).to_batches()) for i in range(0, table.num_rows, step)]
