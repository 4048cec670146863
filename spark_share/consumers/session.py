"""One share consumer, driven by one thread, in explicit acknowledgement mode.

Owns: a confluent-kafka ``ShareConsumer`` and the records it has acquired but not yet
acknowledged (at most one poll's worth, which the client requires). A poll may hand out more than a
batch may take (the broker acquires whole record batches; librdkafka has no strict record limit,
KIP-1206): what the batch's cap has no room for (the tracker says how much it has: ``more``) is carried,
still acquired, and is what the session's next poll returns, so
that no record is released (a release counts toward the delivery limit) to honour a batch's size,
unless it grew too old to be handed out within its lock. Work arrives as commands
(poll, acknowledge, close) on a queue and runs in order on the session's own thread, so an
acknowledgement queued before the next poll is always sent first. librdkafka's statistics (group
state, fetches sent) tell an empty poll when it can stop waiting; while no command comes, the
session thread serves them anyway (``IDLE_SERVE_S``), so they do not pile up in an idle session.

Must never: poll while it holds unacknowledged records, acknowledge a record it did not acquire,
or be touched from another thread (the client is not thread-safe).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

from ..acknowledgement import ACCEPT, RELEASE, AckOutcome
from ..broker_errors import FailureWatch
from ..errors import AgentError, MemberRefused, SourceError
from ..record_ranges import RecordSorter
from ..verdict_set import VerdictSet
from . import records
from .session_acks import Holding, acknowledge_held, error_code
from .session_stats import STATS_INTERVAL_MS, FetchStats

log = logging.getLogger("spark_share.consumers.session")
KAFKA_LOG = logging.getLogger("spark_share.kafka")  # librdkafka's own lines

POLL_SLICE_S = 0.05  # how often an empty poll looks at the fetch state
# A consumer not polled for max.poll.interval.ms (5 min by default: a long trigger, a session the
# pool did not need) leaves the group; its next poll raises this once, and the poll after rejoins.
ERR_MAX_POLL_EXCEEDED = -147
ERR_GROUP_MAX_SIZE_REACHED = 81  # the group is full (group.share.max.size): fatal for this consumer
# librdkafka queues a statistics op (a ~10 KB JSON text) every STATS_INTERVAL_MS on the consumer's
# queue, and only a call on the consumer serves (and frees) it: a session nobody polls for a long
# time (a long processingTime trigger, an idle host) grew by about 0.5 GB an hour. A session that
# has served nothing for IDLE_SERVE_S serves the queue with commit_async(): it acquires nothing
# (unlike poll(), which hands out what librdkafka fetched), and sends nothing when no acknowledgement
# is pending (every command commits its own; only one whose commit_sync failed leaves some, which
# the next poll would send too), even while the session holds records; it runs the queued callbacks
# on the session thread, as poll() does. At most about IDLE_SERVE_S * 1000 / STATS_INTERVAL_MS
# statistics wait at any time.
IDLE_SERVE_S = 1.0
# A real broker may give a new member its partitions only one heartbeat after it joins (Kafka's
# group.share.heartbeat.interval.ms: 5 s by default, at most group.share.max.heartbeat.interval.ms,
# 15 s by default; but see JOIN_NUDGES_S); librdkafka reports the member "init", not "steady", until then. A poll of a
# consumer that was never steady goes on past its own timeout until it is, for at most this long after
# the consumer was created: a first batch (of a Trigger.Once run, say) must not end empty before the
# broker has handed out any partition. Only while no other consumer of the agent has held records for
# longer than JOIN_GRACE_S: those wait for this poll's batch to end, and their lock (at least 15 s on
# Kafka's default bounds) runs meanwhile. Consumers that joined together get their partitions one
# heartbeat (5 s by default) of each other apart at most (JOIN_NUDGES_S: far less on a new group).
JOIN_WAIT_S = 20.0
JOIN_GRACE_S = 8.0
# A share group's partitions are set up (their share-group state) by the first heartbeat of a member that names
# them, and handed out by a later one: the first members of a new group, or of a topic new to it, got theirs one
# heartbeat after they joined. subscribe() to the same topics makes librdkafka send its next heartbeat at once
# ("subscription changed"), and that one carries them: on Kafka 4.2, records 0.1-0.4 s after the join instead of
# 5.1 s. A consumer librdkafka does not yet report with partitions subscribes again at these ages (s), while no
# other consumer of its agent holds records; after the last, the broker's own heartbeat interval runs from it. Each
# moves the consumer's next regular heartbeat, at which one left without partitions by other members (the embedded
# broker gives each partition to one) learns of their leaving, while a batch may wait for it (JOIN_GRACE_S): so
# none later, and none while records wait. A member of a group whose partitions are set up gets them with its first
# heartbeat, and reports them before the first of these.
JOIN_NUDGES_S = (0.1, 0.3, 0.7, 1.5, 3.0)
# A replayed batch's poll that brought none of its records polls again in slices of this long, so that it
# ends soon after the other sessions' polls brought them all.
REPLAY_SLICE_MS = 500
# A replay's sessions ask each fetch for more bytes than any could bring (librdkafka's most), so that the broker
# answers at the fetch's wait and not with the first partition it can serve: when a share group has no member
# left, Kafka drops its share partitions, and a new member's first fetch sets them up again one by one (Kafka
# 4.2: a fetch answered with the first of four, 10 ms in; with this, all four after its wait).
REPLAY_FETCH = {"fetch.min.bytes": "100000000", "fetch.wait.max.ms": "1000"}
# How long a session holding records waits, as the agent stops, for the ones holding none to close first
# (SessionPool.close_all): a close takes about 0.1 s, longer only while the broker cannot be reached.
CLOSE_AFTER_S = 5.0


class ShareSession:
    """A share consumer with its own thread. Methods return Futures."""

    def __init__(self, session_id: str, conf: dict[str, str], topics: list[str], include_headers: bool,
                 scrub: Callable[[str], str] = lambda s: s, idle_serve_s: float = IDLE_SERVE_S,
                 join_wait_s: float = JOIN_WAIT_S,
                 held_elsewhere: Callable[[ShareSession], float] = lambda s: 0.0,
                 sorter: RecordSorter | None = None, replay: bool = False):
        from confluent_kafka import ShareConsumer

        self.session_id = session_id
        self.replay = replay  # polls for a replayed batch (REPLAY_FETCH): replaced once it holds nothing
        self.include_headers = include_headers
        self._topics = list(topics)
        self._nudges = 0  # the JOIN_NUDGES_S sent (all of them once the consumer has partitions)
        self._only_topic = topics[0] if len(topics) == 1 else None
        self.holding: Holding | None = None
        self._carried: list = []  # acquired by the last poll beyond its batch's size: the next poll's records
        self._carried_at = 0.0  # time.time() of the poll that acquired them
        self.released_old = 0  # records given back before any batch saw them, because they grew too old
        self.polls = 0
        self.created_at = time.monotonic()
        self._scrub = scrub
        self._queue: queue.Queue[tuple[Callable, Future] | None] = queue.Queue()
        self._closed = False
        self.max_poll_records = int(conf.get("max.poll.records", 500))
        # An empty poll waits past its timeout this long at most for the statistics that say a fetch was
        # answered empty (a drain needs that answer: see Holding.answered): a few statistics intervals.
        self._answer_wait_s = max(0.5, 3 * int(conf.get("statistics.interval.ms", STATS_INTERVAL_MS)) / 1000.0)
        self._fetch_stats = FetchStats()
        self._idle_serve_s = idle_serve_s
        self._join_wait_s = join_wait_s
        self._held_elsewhere = held_elsewhere  # for how long another consumer of the agent has held records
        self._sorter = sorter  # the run's committed and replayed records (record_ranges)
        self._idle_served_at = time.monotonic()  # the last time the idle session served librdkafka's queue
        self.idle_serves = 0
        self._consumer_closed = False
        self._acks_queued = 0
        self._acks_lock = threading.Lock()
        client_conf: dict[str, Any] = {**conf, **REPLAY_FETCH} if replay else dict(conf)
        client_conf.setdefault("statistics.interval.ms", STATS_INTERVAL_MS)
        client_conf["stats_cb"] = self._on_stats
        self._failures = FailureWatch(conf, scrub)
        client_conf["error_cb"] = self._failures
        client_conf["logger"] = KAFKA_LOG  # librdkafka's lines in the agent's log, rotated with it (not raw stderr)
        self.consumer = ShareConsumer(client_conf)
        try:
            self.consumer.subscribe(self._topics)
        except Exception:
            self.consumer.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"share-session-{session_id}", daemon=True)
        self._thread.start()

    @property
    def carrying(self) -> int:
        """Records acquired beyond a batch's size that this session's next poll returns."""
        return len(self._carried)

    @property
    def busy(self) -> bool:
        """Holds records nobody has asked it to acknowledge yet. Once an acknowledgement is queued
        the session may take its next poll: the queue runs the acknowledgement first."""
        return self.holding is not None and not self._acks_queued

    def _on_stats(self, text: str) -> None:
        # librdkafka's stats_cb, run on the session thread while it serves the client's queue.
        self._fetch_stats.on_stats(text)

    def _submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(AgentError(f"session {self.session_id} is closed"))
            return fut
        self._queue.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._idle_wait())
            except queue.Empty:
                self._serve_idle()
                continue
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to whoever waits on the future
                fut.set_exception(e)

    # commands ---------------------------------------------------------------------------
    def poll(self, batch: int, slot: int, max_records: int | None, timeout_ms: int,
             carry_ms: float | None = None, more: Callable[[int], int] | None = None) -> Future:
        """Acquire one poll for (batch, slot). Result: (RecordBatch, Holding). Returns as soon as
        records arrive; empty once a fetch sent after the poll began came back without any (the
        queue has nothing for this consumer now), or after ``timeout_ms``. Records carried from an
        earlier poll come first, while younger than ``carry_ms`` (older ones are released). A poll
        that brought more than ``max_records`` asks ``more`` (with how many more) how many of them it
        may hand out too; what is left is carried."""
        return self._submit(lambda: self._poll(batch, slot, max_records, timeout_ms, carry_ms, more))

    def acknowledge(self, verdicts: VerdictSet | None, timeout_s: float) -> Future:
        """Acknowledge everything held: ACCEPT unless ``verdicts`` says otherwise. Result: AckOutcome."""
        return self._submit_ack(lambda: self._acknowledge(verdicts, ACCEPT, timeout_s))

    def release_all(self, timeout_s: float) -> Future:
        return self._submit_ack(lambda: self._acknowledge(None, RELEASE, timeout_s))

    def _submit_ack(self, fn: Callable) -> Future:
        with self._acks_lock:
            self._acks_queued += 1

        def run():
            try:
                return fn()
            finally:
                with self._acks_lock:
                    self._acks_queued -= 1
        return self._submit(run)

    def joined(self, timeout_s: float) -> Future:
        """True once librdkafka reports this consumer a steady member of the group (within
        ``timeout_s``; False after it). Serves the consumer's queue meanwhile, acquiring nothing."""
        return self._submit(lambda: self._wait_joined(timeout_s))

    def assigned(self) -> frozenset[tuple[str, int]]:
        """The partitions librdkafka's latest statistics give this consumer (none before it is a steady member)."""
        state = self._fetch_stats.state(0.0)
        return frozenset(state.leaders) if state is not None else frozenset()

    def close(self, after: Sequence[Future] = ()) -> Future:
        """Release what is held (close() does) and leave the group; first wait, at most CLOSE_AFTER_S, for
        ``after`` (other sessions' closing)."""
        fut = self._submit(lambda: self._close(after))
        self._closed = True
        self._queue.put(None)
        return fut

    # on the session thread ----------------------------------------------------------------
    def _idle_wait(self) -> float:
        """How long the session may wait for a command before it serves librdkafka's queue: until
        IDLE_SERVE_S after it was last served (statistics came, or the idle session served it)."""
        last = max(self._fetch_stats.last_at, self._idle_served_at)
        return max(0.0, last + self._idle_serve_s - time.monotonic())

    def _serve_idle(self) -> None:
        """Serve the statistics queued while no command came (see IDLE_SERVE_S), without polling."""
        self._idle_served_at = time.monotonic()
        if self._consumer_closed:
            return
        self.idle_serves += 1
        try:
            self.consumer.commit_async()
        except Exception as e:  # closed underneath, or the client refuses: the next command will say
            log.debug("session %s: serving the idle consumer failed: %s", self.session_id, self._scrub(str(e)))

    def _wait_joined(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while True:
            self._serve_idle()  # statistics reach _on_stats only when the queue is served
            if self._fetch_stats.state(self.created_at) is not None:
                return True
            self._nudge_join()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            # Statistics come every STATS_INTERVAL_MS; librdkafka offers nothing to wait on for them.
            time.sleep(min(left, POLL_SLICE_S))

    def _nudge_join(self) -> None:
        """Subscribe again at the next of JOIN_NUDGES_S while the consumer has no partitions yet."""
        age = time.monotonic() - self.created_at
        if self._nudges >= len(JOIN_NUDGES_S) or age < JOIN_NUDGES_S[self._nudges]:
            return
        state = self._fetch_stats.state(self.created_at)
        # Past the last age (one skipped while records were held, say), the broker's own heartbeat: none later.
        if self._consumer_closed or (state is not None and state.assigned) or age > JOIN_NUDGES_S[-1] + 1.0:
            self._nudges = len(JOIN_NUDGES_S)
            return
        if self._held_elsewhere(self) > 0:
            return
        self._nudges += 1
        try:
            self.consumer.subscribe(self._topics)
        except Exception as e:  # a consumer the broker refused: its poll says why
            self._nudges = len(JOIN_NUDGES_S)
            log.debug("session %s: subscribing again failed: %s", self.session_id, self._scrub(str(e)))

    def _poll(self, batch: int, slot: int, max_records: int | None, timeout_ms: int,
              carry_ms: float | None = None, more: Callable[[int], int] | None = None) -> tuple[Any, Holding]:
        if self.holding is not None:
            raise AgentError(f"session {self.session_id} still holds batch {self.holding.batch} "
                               f"slot {self.holding.slot}; it must be acknowledged first")
        if self._carried and carry_ms is not None and (time.time() - self._carried_at) * 1000 > carry_ms:
            self._release_carried()
        if self._carried:
            # Records a poll acquired beyond its batch's size: this poll's records, without asking the
            # broker (the client allows no poll while any record of the last one is unacknowledged).
            good, acquired_at = self._carried, self._carried_at
            msgs, drained, answered = good, True, frozenset[tuple[str, int]]()
            later: list = []
        else:
            msgs, good, later, drained, answered, acquired_at = self._fetch_sorted(batch, timeout_ms, carry_ms)
        self._carried = []
        if max_records is not None and len(good) > max_records and more is not None:
            max_records += max(0, min(len(good) - max_records, more(len(good) - max_records)))
        if max_records is not None and len(good) > max_records:
            good, self._carried = good[:max_records], good[max_records:]
            self._carried_at = acquired_at
        if later:  # a replayed batch's poll brought records of no batch yet: the next batch's, still acquired
            self._carried, self._carried_at = self._carried + later, acquired_at
        converting = time.perf_counter()
        rb, acquired = records.to_record_batch(good, self.include_headers, self._only_topic)
        holding = Holding(batch, slot, acquired, rb.num_rows, acquired_at, timed_out=not msgs and not drained,
                          convert_s=time.perf_counter() - converting,
                          answered=answered if not msgs and answered else frozenset())
        if rb.num_rows:
            self.holding = holding
        return rb, holding

    def _fetch_sorted(self, batch: int, timeout_ms: int,
                      stale_ms: float | None = None) -> tuple[list, list, list, bool, frozenset, float]:
        """One poll of the broker for ``batch``, its messages sorted (``RecordSorter``): records of a batch Spark
        committed are ACCEPTed at once and never handed out; records older than ``stale_ms`` (fetched while no
        poll ran) are released, and polled again; while ``batch`` is replayed only its own records
        are, the rest wait for the next batch, and a poll that brought none of them polls again (in short
        slices, until every session's polls together brought them all, or ``timeout_ms``: their member may
        still have to be given their partitions, or their lock to expire). A poll that kept nothing of a
        committed batch's records polls again while time is left.
        (messages, the batch's, the next batch's, drained, answered, acquired_at)."""
        from confluent_kafka import AcknowledgeType

        deadline = time.monotonic() + timeout_ms / 1000.0
        sorter = self._sorter if self._sorter is not None and self._sorter.active else None
        replaying = sorter is not None and sorter.wanted(batch) is not None
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            msgs, fetched = self._fetch(min(left_ms, REPLAY_SLICE_MS) if replaying else left_ms)
            drained, answered = fetched is not None, fetched or frozenset()
            good = msgs
            if msgs and any(map(type(msgs[0]).error, msgs)):  # one C-level pass when, as nearly always, none has
                good = [m for m in msgs if m.error() is None]
                for m in msgs:
                    if m.error() is not None:
                        log.warning("session %s: poll returned an error for %s-%s: %s", self.session_id,
                                    m.topic(), m.partition(), self._scrub(str(m.error())))
            acquired_at = self._received_at(len(good))
            if good and stale_ms is not None and (time.time() - acquired_at) * 1000 > stale_ms:
                # Fetched long before this poll, while nobody polled: given back before any batch sees them,
                # they come again at once with a fresh lock (kept, they would expire inside the batch).
                self._release_old(good, acquired_at, "fetched while no poll ran")
                if time.monotonic() < deadline:
                    continue
                return [], [], [], False, frozenset(), time.time()
            done: list = []
            later: list = []
            if sorter is not None and good:
                good, done, later = sorter.sort(batch, good)
                for m in done:  # sent with the next poll or commit, as every acknowledgement is
                    self.consumer.acknowledge(m, AcknowledgeType.ACCEPT)
                if done:
                    log.info("session %s: %d records of a batch Spark committed came back; ACCEPTed, not handed out",
                             self.session_id, len(done))
            if good or later or time.monotonic() >= deadline:
                return msgs, good, later, drained, answered, acquired_at
            if not done and not (replaying and sorter is not None and sorter.waiting(batch)):
                return msgs, good, later, drained, answered, acquired_at

    def _release_carried(self) -> None:
        """Give back carried records too old to be handed out within their lock: released now, they
        are delivered again at once (left, they would expire, and come back later)."""
        carried, self._carried = self._carried, []
        self._release_old(carried, self._carried_at, "a poll acquired beyond its batch")

    def _release_old(self, msgs: list, acquired_at: float, what: str) -> None:
        from confluent_kafka import AcknowledgeType

        for m in msgs:
            self.consumer.acknowledge(m, AcknowledgeType.RELEASE)
        res = self.consumer.commit_sync(30.0)  # a lock already expired: INVALID_RECORD_STATE, and it is free anyway
        bad = {f"{tp.topic}-{tp.partition}": str(e) for tp, e in (res or {}).items() if e is not None}
        self.released_old += len(msgs)
        log.info("session %s: released %d records %s, %.1f s ago: too old to be handed out within the record "
                 "lock%s", self.session_id, len(msgs), what, time.time() - acquired_at, f" (failed for {bad})" if bad else "")

    def _received_at(self, handed: int) -> float:
        """When the ``handed`` records of the poll that just returned can have been acquired at the earliest
        (time.time()): now, unless statistics say records came in while nobody polled (after a poll that
        returned nothing, librdkafka fetches on its own and keeps what comes for the next poll), then
        from the last statistics before they came. Records counted from here on are the next poll's."""
        now = time.monotonic()
        since = self._fetch_stats.fetched_after
        self._fetch_stats.mark(now, handed)
        return time.time() - (now - since if since is not None else 0.0)

    def _fetch(self, timeout_ms: int) -> tuple[list, frozenset | None]:
        """One poll of the broker: (its messages; for an empty answer that means the queue has nothing
        for this consumer now, rather than that time ran out, the partitions the broker answered for,
        else None)."""
        self.polls += 1
        started = time.monotonic()
        deadline = started + timeout_ms / 1000.0
        joined_by = self.created_at + self._join_wait_s
        base: dict[str, int] = {}
        assigned_at_base: set = set()
        msgs: list = []
        rejoining = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            wait = min(left, POLL_SLICE_S) if left or self._fetch_stats.steady else POLL_SLICE_S  # not joined: wait on
            try:
                msgs = list(self.consumer.poll(wait))
            except Exception as e:
                if error_code(e)[0] == ERR_GROUP_MAX_SIZE_REACHED:
                    raise MemberRefused(
                        f"share session {self.session_id} was refused by the share group: it has reached the "
                        "broker's group.share.max.size (members of a share group, 200 by default)") from None
                if error_code(e)[0] != ERR_MAX_POLL_EXCEEDED or rejoining:
                    raise
                log.info("session %s: left the group after max.poll.interval.ms without a poll; rejoining",
                         self.session_id)
                rejoining = True
                continue
            now = time.monotonic()
            if msgs:
                self._nudges = len(JOIN_NUDGES_S)
                return msgs, None
            self._nudge_join()
            if now >= deadline and (now >= deadline + self._answer_wait_s if self._fetch_stats.steady
                                    else now >= joined_by or self._held_elsewhere(self) > JOIN_GRACE_S):
                return msgs, None
            if self._failures.failure:  # the broker refused this consumer: say so, not "no records"
                raise SourceError(self._failures.failure)
            answered = self._fetch_stats.drained(started, base, assigned_at_base)
            if answered is not None:
                return msgs, answered

    def _acknowledge(self, verdicts, default: int, timeout_s: float) -> AckOutcome:
        h, self.holding = self.holding, None
        return acknowledge_held(self.consumer, h, verdicts, default, timeout_s, self._scrub, self.session_id)

    def _close(self, after: Sequence[Future] = ()) -> None:
        if after:
            wait_futures(after, timeout=CLOSE_AFTER_S)
        self.holding = None
        self._carried = []  # close() releases them with the rest
        self._consumer_closed = True
        self.consumer.close()
