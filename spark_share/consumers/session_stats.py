"""What librdkafka's statistics say of one share consumer: a steady member with partitions or not yet,
and whether a fetch sent after a moment has been answered.

Owns: the latest statistics text (``on_stats`` is the client's ``stats_cb``), parsing each text once,
``steady`` (the consumer has been reported a steady member at least once), ``drained``, which
lets an empty poll end as soon as the broker has nothing for the consumer instead of at its timeout, and
``fetched_after``: when records came in since the last poll, while nobody polled (after a poll that
returned nothing, librdkafka goes on fetching, and the broker's lock on what it acquires runs from then).

Must never: call the consumer: statistics arrive only while the session thread serves the client's
queue, and only that thread may.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

STATS_INTERVAL_MS = "100"  # how often librdkafka reports the group and fetch state an empty poll ends on


def stats_interval_ms(partitions: int) -> int:
    """librdkafka's statistics name every partition of the subscribed topics (about 750 bytes each: 1.5 MB
    at 2,000 partitions, which cost a consumer 15% of a core every 100 ms): they come less often on big
    topics, a quarter of a millisecond per partition, 100 ms to 2.5 s."""
    return max(int(STATS_INTERVAL_MS), min(2500, partitions // 4))


Partition = tuple[str, int]


@dataclass(frozen=True)
class FetchState:
    """What one statistics text says of a steady member."""
    assigned: bool  # it has partitions
    sent: dict[str, int]  # ShareFetch requests sent, per broker name
    leaders: dict[Partition, str]  # each assigned partition's leader, by broker name


def parse_stats(text: str) -> tuple[float, FetchState | None]:
    """(when librdkafka took them, in time.monotonic() seconds; the member's ``FetchState`` once the
    consumer is a steady member, else None) of a statistics text. Assigned partitions are the ones
    librdkafka marks ``desired``."""
    try:
        st = json.loads(text)
        stamped = st["ts"] / 1e6
        cgrp = st.get("cgrp") or {}
        sent = {name: b["req"]["ShareFetch"] for name, b in st["brokers"].items()
                if b.get("req", {}).get("ShareFetch")}
        if cgrp.get("join_state") != "steady":
            return stamped, None
        names = {b.get("nodeid"): name for name, b in st["brokers"].items()}
        leaders = {(t, int(p)): names.get(v.get("leader"), "")
                   for t, tv in (st.get("topics") or {}).items() for p, v in tv["partitions"].items()
                   if v.get("desired") and int(p) >= 0}
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0.0, None
    return stamped, FetchState(cgrp.get("assignment_size", 0) > 0, sent, leaders)


def _stamp_and_received(text: str) -> tuple[float, int]:
    """(librdkafka's stamp, in time.monotonic() seconds; the messages received so far, the text's top-level
    "rxmsgs", its last but one key) of a statistics text; (0, 0) if it has neither."""
    try:
        return _number_after(text, text.index('"ts":') + 5) / 1e6, _number_after(text, text.rindex('"rxmsgs":') + 9)
    except ValueError:
        return 0.0, 0


def _number_after(text: str, at: int) -> int:
    end = at
    while end < len(text) and text[end] in " 0123456789":
        end += 1
    return int(text[at:end])


class FetchStats:
    def __init__(self) -> None:
        self._stats: tuple[float, str] = (0.0, "")  # (when, text) of librdkafka's latest statistics
        self._parsed: tuple[float, tuple[float, FetchState | None]] = (0.0, (0.0, None))
        self.steady = False  # librdkafka has reported this consumer a steady member (with its assignment)
        # Records received since the last poll returned (librdkafka's "rxmsgs" going up past ``_rx_base``):
        # the time of the last text before they came, the earliest they can have been acquired (None:
        # none came). ``_rx_last``: the count of the latest text.
        self._mark = 0.0
        self._rx_base: int | None = None
        self._rx_last: int | None = None
        self._base_before = False
        self._quiet_at = 0.0
        self.fetched_after: float | None = None

    @property
    def last_at(self) -> float:
        """time.monotonic() when the latest statistics were served."""
        return self._stats[0]

    @property
    def text(self) -> str:
        """The latest statistics text (JSON), "" before any."""
        return self._stats[1]

    def on_stats(self, text: str) -> None:
        # Served inside poll() (or commit_sync/commit_async, see _serve_idle); parsed only when an
        # empty poll looks at it. Its stamp and received-messages count are read off every text (they are
        # at its two ends: a big topic's text is 1.5 MB).
        self._stats = (time.monotonic(), text)
        # The count is librdkafka's of records parsed, before it keeps those the broker acquired for this
        # consumer (a fetch brings whole producer batches): it runs ahead of what polls hand out, so it
        # is compared with a base taken at each poll, never with a total of them.
        stamped, rx = _stamp_and_received(text)
        self._rx_last = rx
        if stamped <= self._mark:  # taken before the last poll returned
            if self._base_before:
                self._rx_base = rx
            return
        if self._rx_base is None:
            self._rx_base, self._quiet_at = rx, stamped
        elif rx <= self._rx_base:
            self._quiet_at = stamped
        elif self.fetched_after is None:
            self.fetched_after = self._quiet_at

    def mark(self, now: float, handed: int) -> None:
        """A poll returned (``now``, time.monotonic()) with ``handed`` records: records counted from here on
        came while nobody polled. After an empty poll they are counted from the last text before it
        returned (the fetch in flight then is often answered before the next text: Kafka 4.2); after one
        that handed records out, from the first text after it (the last before may not count them)."""
        self._mark, self._quiet_at, self.fetched_after = now, now, None
        self._base_before = handed == 0
        self._rx_base = self._rx_last if self._base_before else None

    def state(self, since: float) -> FetchState | None:
        """The member's state from statistics taken after ``since`` (a time.monotonic(); librdkafka
        stamps them on the same clock, in microseconds: they may be served well after they were
        taken); None when there are none yet, or it is not a steady member."""
        when, text = self._stats
        if when <= since or not text:
            return None
        if self._parsed[0] != when:  # an empty poll looks every POLL_SLICE_S: parse each text once
            self._parsed = (when, parse_stats(text))
        stamped, state = self._parsed[1]
        if state is not None:
            self.steady = True
        return state if stamped > since else None

    def drained(self, started: float, base: dict[str, int],
                assigned_at_base: set[Partition] | None = None) -> frozenset[Partition] | None:
        """Has every broker this consumer fetches from answered a fetch sent after the poll began?
        None if not yet; else the assigned partitions those answers covered (those whose leader is
        one of them: a partition no fetch went out for is not answered). ``base`` holds the first
        counts seen after the poll began, ``assigned_at_base`` the partitions assigned then. A consumer
        in the group with no partitions (more consumers than partitions on a broker that does not share
        them) has nothing to wait for."""
        state = self.state(started)
        if state is None:
            return None
        if not state.assigned:
            return frozenset()
        if not base:
            base.update(state.sent)
            if assigned_at_base is not None:
                assigned_at_base.update(state.leaders)
            return None
        # Fetches go out one at a time per broker: a count two past the first one seen after the
        # poll began means a fetch sent after it has been answered (with nothing, or poll() would
        # have returned its records).
        if not state.sent or not all(state.sent.get(b, 0) >= n + 2 for b, n in base.items()):
            return None
        # Only partitions assigned when ``base`` was taken: one assigned since (another member left) may
        # have had no fetch yet, and a drain took the empty answer for it as "nothing there", ending with
        # that partition unread (seen once in CI: 200 of 400 records).
        return frozenset(tp for tp, leader in state.leaders.items()
                         if leader in base and (assigned_at_base is None or tp in assigned_at_base))
