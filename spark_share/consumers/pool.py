"""The share sessions of one agent: which are free, which a read holds, which polled ahead.

Owns: starting sessions (all a batch needs at once, so no member joins mid-batch), choosing the
session a read of a batch polls with (every session once per batch before any is reused), polls
started ahead of a batch's read tasks, replacing sessions when the batch size is lowered, and closing
the sessions the tracker says the query no longer needs here (the group's members are capped).

Must never: hand a read a session that still holds records no acknowledgement has been queued for
(``busy``), or one another read holds; open a session the tracker did not grant (``open``), or close
one that holds or carries records (``trim``); after a replayed batch, let a session join, leave or
fetch while the replay's sessions are in place (``_replay_left``); keep a session that joined after ``close_all`` (the
agent's shutdown can come while its first sessions join).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

from ..errors import AgentError
from . import records

if TYPE_CHECKING:
    from .session import ShareSession

log = logging.getLogger("spark_share.consumers.agent")

# A new share consumer must join the group before records flow: its first poll may wait until it is
# this old, unless librdkafka reports earlier that it joined and fetched (see ShareSession.poll), so
# an AvailableNow run does not end early. (A consumer still waiting for its partitions waits longer:
# ShareSession.JOIN_WAIT_S.)
FIRST_POLL_MIN_MS = 5000
# How long start() waits at most for its sessions to report that they joined (about 0.1 s on the
# embedded broker: the first statistics after the join).
JOIN_SETTLE_S = 1.0
# How often await_assignment looks at the sessions' statistics (each serves them about every second).
ASSIGNMENT_POLL_S = 0.1


def poll_budget(session, poll_timeout_ms: int) -> int:
    """How long a poll of ``session`` may wait: ``pollTimeoutMs``, longer for a new member's first."""
    if session.polls:
        return poll_timeout_ms
    # A session's first poll may wait until it is FIRST_POLL_MIN_MS old (it joins meanwhile), or
    # less once librdkafka reports it joined with partitions and fetched since.
    age_ms = (time.monotonic() - session.created_at) * 1000
    return max(poll_timeout_ms, int(FIRST_POLL_MIN_MS - age_ms))


class SessionPool:
    def __init__(self, new_session: Callable[[int | None, bool], ShareSession], name: str = "agent"):
        self._new = new_session  # a new session, joining the group (max.poll.records, or the config's; for a replay)
        self.name = name
        self._lock = threading.Lock()
        self._resize_lock = threading.Lock()
        self.sessions: list[ShareSession] = []
        self._reserved: set[ShareSession] = set()
        self._prefetched: dict[ShareSession, Future] = {}  # session -> its poll that no read has claimed yet
        self._last_taken: dict[str, tuple[int, float]] = {}  # session id -> (batch, when) of its last poll
        self.full_size: int | None = None  # max.poll.records of a session started without a budget
        self._joined = False  # the first start() is done
        self._pending_prefetch: tuple | None = None  # a prefetch that came while the first sessions joined
        self._closed = False  # close_all() came: a session that joins after it leaves at once
        self._settle = threading.Event()  # set by close_all(): a wait for the group to settle ends
        self._replay_batch = -1  # the last batch ``fit`` made sessions for

    def __len__(self) -> int:
        return len(self.sessions)

    def start(self, n: int, max_poll_records: int | None = None, replay: bool = False) -> None:
        """Join the group with every session a batch needs before any of them acquires records.

        A member joining later makes the group rebalance; the embedded broker ends the other
        members' share sessions then and hands their acquired records out again (duplicates)."""
        sessions = [self._new(max_poll_records, replay) for _ in range(n)]
        joining = [s.joined(JOIN_SETTLE_S) for s in sessions]
        records.warm_up()  # meanwhile: the first conversion's one-time imports (pandas, through pyarrow)
        wait_futures(joining, timeout=JOIN_SETTLE_S + 5)
        with self._lock:
            closed = self._closed
            if not closed:
                self.sessions.extend(sessions)
            if max_poll_records is None and sessions:
                self.full_size = sessions[0].max_poll_records
            pending, self._pending_prefetch = self._pending_prefetch, None
            self._joined = True
        if closed:  # the agent's shutdown came while they joined (a stop as the query started): they leave too
            wait_futures([s.close() for s in sessions], timeout=JOIN_SETTLE_S + 5)
            return
        log.info("%s: %d share sessions (max.poll.records %s) joined the group", self.name, n,
                 sessions[0].max_poll_records if sessions else "-")
        if pending:
            self.prefetch(*pending)

    def reserve(self, batch: int, max_records: int | None) -> tuple[ShareSession | None, Future | None]:
        """Reserve a free session for a read of ``batch``: (session, its prefetched poll or None), or
        (None, None) when none is free: whether a new one may join the group is the tracker's to say
        (the query's members are capped), and ``open`` starts it.

        A session that polled ahead for this batch (``prefetch``) comes first; otherwise a free
        session whose polls are no bigger than ``max_records``.

        Sessions not yet polled in this batch come first, then the longest unpolled: the broker
        gives each member its own partitions, so a session that is never polled leaves its
        partitions unread (an empty poll frees a session at once, and reusing it for the next slot
        starved the others and ended AvailableNow runs early).

        When the tracker lowers the batch size (after lock expiry), every free session is replaced
        by one with a smaller max.poll.records, all at once: trimming a bigger poll would mean
        releasing the excess, and every release counts as a delivery. When it raises it again,
        sessions smaller than the new size are replaced the same way."""
        with self._resize_lock:
            self._resize(max_records, batch)
            with self._lock:
                fits = [s for s in self._prefetched if s not in self._reserved] + self._free(max_records, batch)
                if not fits:
                    return None, None
                s = min(fits, key=lambda s: (s not in self._prefetched, self._poll_order(s, batch)))
                self._reserve(s, batch)
                return s, self._prefetched.pop(s, None)

    def open(self, batch: int, max_records: int | None) -> ShareSession:
        """A new session, reserved for a read of ``batch`` (the tracker granted the member)."""
        s = self._new(max_records, False)
        with self._lock:
            closed = self._closed
            if not closed:
                self.sessions.append(s)
                self._reserve(s, batch)
        if closed:
            s.close()
            raise AgentError(f"{self.name} is shutting down: no share session opens")
        log.info("%s: started share session %s", self.name, s.session_id)
        return s

    def drop(self, session: ShareSession) -> None:
        """Close a session the group refused (or that failed for good) and forget it."""
        with self._lock:
            if session in self.sessions:
                self.sessions.remove(session)
            self._reserved.discard(session)
            self._prefetched.pop(session, None)
            self._last_taken.pop(session.session_id, None)
        session.close()

    def trim(self, not_since_batch: int, idle_s: float, at_most: int | None = None) -> int:
        """Close free sessions (none carrying records) that have polled neither in a batch from
        ``not_since_batch`` on nor for ``idle_s`` (since they started, if they never polled), the longest
        unpolled first, at most ``at_most``; returns how many left the group (they have, on return)."""
        now = time.monotonic()
        with self._resize_lock:
            with self._lock:
                def last(s):
                    return self._last_taken.get(s.session_id, (-1, s.created_at))

                idle = [] if self._replay_left() else sorted(
                    (s for s in self._free() if not s.carrying
                     and last(s)[0] < not_since_batch and now - last(s)[1] >= idle_s),
                    key=lambda s: last(s)[1])[:at_most]
                for s in idle:
                    self.sessions.remove(s)
                    self._last_taken.pop(s.session_id, None)
            wait_futures([s.close() for s in idle], timeout=10)
        if idle:
            log.info("%s: closed %d share sessions no read used (%s); %d left", self.name, len(idle),
                     ", ".join(s.session_id for s in idle), len(self.sessions))
        return len(idle)

    def carrying_for(self, batch: int) -> int:
        """The records carried by the session a read of ``batch`` would take now (``reserve`` prefers one
        that carries records and has not polled in this batch): the tracker may grant that read more."""
        with self._lock:
            carriers = [s for s in self._free() if s.carrying and self._last_taken.get(s.session_id, (-1,))[0] != batch]
            best = max(carriers, key=lambda s: s.carrying, default=None)
            return best.carrying if best is not None else 0

    def _size_for(self, max_records: int | None) -> int | None:
        """max.poll.records of a session for reads with this budget (None: any size will do)."""
        if max_records is None:
            return self.full_size
        return max_records if self.full_size is None else min(max_records, self.full_size)

    def _resize(self, max_records: int | None, batch: int) -> None:
        """Replace every free session whose polls are bigger than the budget; or, when every session
        is free, smaller than it may now be. Call with ``_resize_lock`` held.

        Growing waits until no session holds records: on the embedded broker a member joining ends
        the other members' share sessions, and what they hold would be delivered again."""
        want = self._size_for(max_records)
        if want is None:
            return
        with self._lock:
            # A session carrying records (acquired beyond a batch's size) keeps its size until it has
            # handed them out: closing it would release them, and every release counts as a delivery.
            free = [s for s in self._free() if not s.carrying]
            if any(s.replay for s in self.sessions):
                # Made for a replayed batch (their fetches wait, which only a replay wants): kept while it reads
                # and while they hand out what it acquired beyond it (_replay_left), then replaced all at once.
                if batch <= self._replay_batch or len(free) != len(self.sessions):
                    return
            else:
                shrink = max_records is not None and any(s.max_poll_records > want for s in free)  # None: no cap
                grow = len(free) == len(self.sessions) and any(s.max_poll_records < want for s in free)
                if not (shrink or grow):
                    return
            for s in free:
                self.sessions.remove(s)
                self._last_taken.pop(s.session_id, None)
        wait_futures([s.close() for s in free], timeout=30)
        self.start(len(free), None if want == self.full_size else want)
        log.info("%s: batch size changed: polls now take at most %d records", self.name, want)

    def fit(self, batch: int, records: int) -> None:
        """Sessions for a replayed batch, in place of the run's: polls of ``records`` (the client polls a
        session again only once its last poll is acknowledged, so each session gets one poll of the batch,
        and a broker may hand one member all of its records), and fetches that wait for every partition
        (``session.REPLAY_FETCH``). Only while no session holds or carries records (a replay is a run's first
        batch). What their polls acquire beyond the batch they carry: the next batches take it from them first
        (``_replay_left``), and the first that finds them free and carrying nothing replaces them all
        (``_resize``)."""
        with self._resize_lock:
            self._replay_batch = batch
            with self._lock:
                free = [s for s in self._free() if not s.carrying]
                if len(free) != len(self.sessions) or all(s.replay and s.max_poll_records >= records for s in free):
                    return
                for s in free:
                    self.sessions.remove(s)
                    self._last_taken.pop(s.session_id, None)
            wait_futures([s.close() for s in free], timeout=30)
            self.start(len(free), records, replay=True)
            log.info("%s: polls take up to %d records for a replayed batch", self.name, records)

    def await_assignment(self, partitions: Iterable[tuple[str, int]], timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, until the sessions' assignments together cover ``partitions`` (a replayed
        batch's): each session polls once for a replay, and one whose poll brought records polls again only
        after their acknowledgement, so a partition the broker gives it later stays unread. (Seen on Kafka
        4.2: ``fit`` replaced the sessions, and a heartbeat later the broker gave the leavers' partition to
        the member already holding the other one's records.)"""
        want = set(partitions)
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                sessions, closed = list(self.sessions), self._closed
            have = set().union(*(s.assigned() for s in sessions))
            if want <= have or closed:
                return want <= have
            if time.monotonic() >= deadline:
                log.info("%s: the share sessions were not given partitions %s within %.0f s; reading without them",
                         self.name, sorted(want - have)[:5], timeout_s)
                return False
            self._settle.wait(ASSIGNMENT_POLL_S)

    def prefetch(self, batch: int, count: int, max_records: int | None, poll_timeout_ms: int,
                 carry_ms: float | None = None) -> int:
        """Start the polls of ``batch`` on up to ``count`` free sessions now, while Spark still
        writes its offsets and schedules the read tasks: the reads then find them done or under
        way. A poll no read of this batch claims is claimed by the next one (its records stay
        held until then, and are released if the query stops)."""
        with self._resize_lock:
            self._resize(max_records, batch)
        with self._lock:
            if not self._joined:  # the tracker planned the batch while the sessions join: poll once they have
                self._pending_prefetch = (batch, count, max_records, poll_timeout_ms, carry_ms)
                return 0
            chosen = sorted(self._free(max_records, batch), key=lambda s: self._poll_order(s, batch))[:count]
            for s in chosen:
                self._prefetched[s] = s.poll(batch, -1, max_records, poll_budget(s, poll_timeout_ms), carry_ms)
                self._last_taken[s.session_id] = (batch, time.monotonic())
        return len(chosen)

    def _free(self, max_records: int | None = None, batch: int | None = None) -> list:
        """Sessions no read holds, with no poll started ahead and nothing awaiting an acknowledgement
        (polls no bigger than ``max_records``, if given; for a read of ``batch``, if given, after a replay
        only those handing out what the replay acquired beyond its batch). Call with ``_lock`` held."""
        free = [s for s in self.sessions if s not in self._reserved and not s.busy and s not in self._prefetched
                and (max_records is None or s.max_poll_records <= max_records or s.carrying)]
        if batch is not None and self._replay_left(batch):
            free = [s for s in free if s.carrying]  # a replay's polls (the lock budget) are its batch's alone
        return free

    def _replay_left(self, batch: int | None = None) -> bool:
        """After a replayed batch (any batch, if None), while its sessions are still in place: they hand out
        what its polls acquired beyond it to the next batches, and no session joins, leaves or fetches until
        all are free and none carries; then all of them are replaced at once (``_resize``). A member joining
        or leaving makes the group rebalance: on the embedded broker the other members' share sessions end,
        and what they hold or carry would be delivered again; on Kafka partitions move under them. Call with
        ``_lock`` held."""
        return (batch is None or batch > self._replay_batch) and any(s.replay for s in self.sessions)

    def may_join(self, batch: int) -> bool:
        """Whether a read of ``batch`` that found no session free may ask for a new member."""
        with self._lock:
            return not self._replay_left(batch)

    def _poll_order(self, session, batch: int) -> tuple[bool, bool, float]:
        """Not yet polled in this batch first; among those, one carrying records (its poll hands them
        out before their lock runs low), then the longest unpolled."""
        last_batch, when = self._last_taken.get(session.session_id, (-1, 0.0))
        return last_batch == batch, not session.carrying, when

    def _reserve(self, session, batch: int) -> None:
        self._reserved.add(session)
        self._last_taken[session.session_id] = (batch, time.monotonic())

    def held_elsewhere(self, session: ShareSession) -> float:
        """For how long (s) a session other than ``session`` has held records (their lock runs while a
        batch waits); 0 when none does."""
        held = [s.holding.acquired_at for s in list(self.sessions) if s is not session and s.holding is not None]
        return time.time() - min(held) if held else 0.0

    def give_back(self, session: ShareSession) -> None:
        """A read is done with ``session`` (its records, if any, wait for the batch's acknowledgement)."""
        with self._lock:
            self._reserved.discard(session)

    def release(self, session: ShareSession) -> None:
        """``session``'s acknowledgement is queued: free for the next batch (its poll queues behind it)."""
        with self._lock:
            self._reserved.discard(session)

    def close_all(self) -> list:
        """Close every session (releasing what each holds); the futures of their closing. The ones that hold
        nothing close first: after a poll that returned nothing the client fetches on its own, and would
        acquire what a closing sibling releases, then drop it as it closes too (a delivery spent each time,
        unseen; on Kafka, which shares partitions between members, a replay then got records at delivery 3).
        A session that holds records fetches nothing until its next poll."""
        with self._lock:
            self._closed = True
            sessions, self.sessions = list(self.sessions), []
        self._settle.set()
        idle = [s for s in sessions if s.holding is None and not s.carrying]
        first = [s.close() for s in idle]
        return first + [s.close(after=first) for s in sessions if s not in idle]
