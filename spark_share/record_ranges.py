"""A batch's records as offset runs per topic-partition: what the offset log names of a batch, so that Spark
running the batch again gets the same records, and records of a committed batch are never emitted again.

Owns: ``RecordRanges`` (made from what a batch's slots acquired, or from an offset), its compact text form in
the offset (delta-coded varints, zlib, base85: one run per partition at 2,000 partitions, far into their logs,
about 11 KB), which of one poll's messages it holds (NumPy, no Python loop per message), and what is missing of it.
``RecordSorter``: the sets a run's sessions sort their polls by (records of a batch Spark committed, records
of a batch being replayed).

Shared by the driver (the offset it writes) and the consumers (the sessions that sort what they acquire).

Must never: hold a Python object per record, or accept text that is not its own format (offsets come from a
checkpoint a user may have edited): a bad text is a ``SourceError``, never code run or a crash.
"""
from __future__ import annotations

import base64
import bisect
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from .errors import SourceError

PREFIX = "z1:"  # the text form's version
UNREADABLE = ("the kafka-share offset's records are not readable (the checkpoint's offset log was edited or written "
              "by another version): start the query with a new checkpointLocation")
Partition = tuple[str, int]


class RecordRanges:
    """Sorted, merged, inclusive [first, last] offset runs per (topic, partition)."""

    def __init__(self, runs: Mapping[Partition, Sequence[Sequence[int]]] | None = None):
        self.runs: dict[Partition, list[tuple[int, int]]] = {}
        for tp, rs in (runs or {}).items():
            merged = _merge(rs)
            if merged:
                self.runs[tp] = merged
        self._starts = {tp: np.fromiter((a for a, _ in rs), np.int64, len(rs)) for tp, rs in self.runs.items()}
        self._ends = {tp: np.fromiter((b for _, b in rs), np.int64, len(rs)) for tp, rs in self.runs.items()}

    @classmethod
    def of_acquired(cls, acquired: Iterable[Mapping]) -> RecordRanges:
        """From the ``offsets`` ({topic: {partition: [[first, last], ...]}}) of a batch's slots."""
        runs: dict[Partition, list] = {}
        for a in acquired:
            for topic, parts in (a.get("offsets") or {}).items():
                for p, rs in parts.items():
                    runs.setdefault((topic, int(p)), []).extend(rs)
        return cls(runs)

    def __len__(self) -> int:
        return sum(b - a + 1 for rs in self.runs.values() for a, b in rs)

    def __bool__(self) -> bool:
        return bool(self.runs)

    def __eq__(self, other) -> bool:
        return isinstance(other, RecordRanges) and self.runs == other.runs

    # --- the text form in the offset ------------------------------------------------------------------
    def encode(self) -> str:
        """``z1:`` + base85(zlib(varints)): per topic its name, then per partition the gap from the last
        partition, its runs, and per run the gap from the last run's end and its length. Small numbers
        wherever the records allow; a run far into a log costs its offset's bytes and no more."""
        out = bytearray()
        topics: dict[str, list] = {}
        for (topic, p), rs in sorted(self.runs.items()):
            topics.setdefault(topic, []).append((p, rs))
        _varint(out, len(topics))
        for topic, parts in topics.items():
            name = topic.encode()
            _varint(out, len(name))
            out += name
            _varint(out, len(parts))
            last_p = -1
            for p, rs in parts:
                _varint(out, p - last_p - 1)
                last_p = p
                _varint(out, len(rs))
                end = -1
                for a, b in rs:
                    _varint(out, a - end - 1)
                    _varint(out, b - a)
                    end = b
        return PREFIX + base64.b85encode(zlib.compress(bytes(out), 9)).decode("ascii")

    @classmethod
    def decode(cls, text: str) -> RecordRanges:
        bad = SourceError(UNREADABLE)
        if not isinstance(text, str) or not text.startswith(PREFIX) or len(text) > 64 << 20:
            raise bad
        try:
            data = zlib.decompress(base64.b85decode(text[len(PREFIX):]), bufsize=1 << 16)
            at = [0]
            runs: dict[Partition, list[tuple[int, int]]] = {}
            for _ in range(_read_varint(data, at)):
                n = _read_varint(data, at)
                topic = data[at[0]:at[0] + n].decode()
                at[0] += n
                p = -1
                for _ in range(_read_varint(data, at)):
                    p += _read_varint(data, at) + 1
                    end, rs = -1, []
                    for _ in range(_read_varint(data, at)):
                        a = end + 1 + _read_varint(data, at)
                        end = a + _read_varint(data, at)
                        rs.append((a, end))
                    runs[(topic, p)] = rs
            if at[0] != len(data):
                raise bad
        except (ValueError, TypeError, IndexError, UnicodeDecodeError, zlib.error) as e:
            raise bad from e
        return cls(runs)

    # --- membership -----------------------------------------------------------------------------------
    def contains(self, topic: str, partition: int, offset: int) -> bool:
        rs = self.runs.get((topic, partition))
        if not rs:
            return False
        i = bisect.bisect_right(rs, (offset, float("inf"))) - 1
        return i >= 0 and rs[i][0] <= offset <= rs[i][1]

    def mask(self, topic: str, partition: int, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` (one partition's) are in the set."""
        starts = self._starts.get((topic, partition))
        if starts is None:
            return np.zeros(len(offsets), bool)
        i = np.searchsorted(starts, offsets, side="right") - 1
        ok = i >= 0
        inside = np.zeros(len(offsets), bool)
        inside[ok] = offsets[ok] <= self._ends[(topic, partition)][i[ok]]
        return inside

    def minus(self, other: RecordRanges) -> RecordRanges:
        """The records of this set that ``other`` does not hold."""
        out: dict[Partition, list[tuple[int, int]]] = {}
        for tp, rs in self.runs.items():
            theirs = other.runs.get(tp, [])
            left: list[tuple[int, int]] = []
            for a, b in rs:
                at = a
                for c, d in theirs:
                    if d < at or c > b:
                        continue
                    if c > at:
                        left.append((at, c - 1))
                    at = max(at, d + 1)
                if at <= b:
                    left.append((at, b))
            if left:
                out[tp] = left
        return RecordRanges(out)

    def union(self, other: RecordRanges) -> RecordRanges:
        runs: dict[Partition, list] = {tp: list(rs) for tp, rs in self.runs.items()}
        for tp, rs in other.runs.items():
            runs.setdefault(tp, []).extend(rs)
        return RecordRanges(runs)

    def described(self, limit: int = 5) -> str:
        """A few of its runs, for a log line."""
        shown = [f"{t}-{p}@{a}..{b}" for (t, p), rs in sorted(self.runs.items()) for a, b in rs][:limit]
        return ", ".join(shown) + (" ..." if sum(map(len, self.runs.values())) > limit else "")


def _varint(out: bytearray, n: int) -> None:
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _read_varint(data: bytes, at: list[int]) -> int:
    n = shift = 0
    while True:
        byte = data[at[0]]
        at[0] += 1
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            return n
        shift += 7
        if shift > 63:
            raise SourceError(UNREADABLE)


def _merge(runs: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(r[0]), int(r[1])) for r in runs):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class RecordSorter:
    """What a run's sessions sort each poll by: records of a batch Spark committed (ACCEPTed at once, never
    handed out) and, while a batch is replayed, that batch's records (handed out to it; anything else the
    poll acquired waits, still acquired, for the next batch). Thread-safe: every session consults it.

    Committed records are an earlier run's committed batches, the batches this run is ACCEPTing (from before
    their acknowledgements are sent until the broker took them all) and those whose ACCEPT the broker refused
    (a lock that expired before the commit): only a record of these can come back, and only what failed stays."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.committed = RecordRanges()
        self._kept = RecordRanges()  # committed for good: an earlier run's batches, ACCEPTs that failed
        # An earlier run's committed records (from offsets), since when the first run that noted them did, and
        # those of them that came back here: the rest may still come back to a later run (``pending``).
        self._earlier = RecordRanges()
        self._earlier_since: float | None = None
        self._returned = RecordRanges()
        self._accepting: dict[int, RecordRanges] = {}  # batch -> its records whose ACCEPT is on its way
        self.replays: dict[int, RecordRanges] = {}
        self._missing: dict[int, int] = {}  # replayed batch -> how many of its records no poll brought yet
        self._hold_s: dict[int, float] = {}  # replayed batch -> how long it may wait once it holds records
        self._holding_since: dict[int, float] = {}  # replayed batch -> when a poll first brought some of them
        self.accepted_again = 0  # records of a committed batch that came back and were ACCEPTed unseen

    @property
    def active(self) -> bool:
        return bool(self.committed) or bool(self.replays)

    def commit(self, ranges: RecordRanges, since: float | None = None) -> None:
        """Records of a batch Spark committed (an earlier run's: it may not have acknowledged them), pending
        since ``since`` (time.time(); now if not given)."""
        with self._lock:
            self._kept = self._kept.union(ranges)
            self._earlier = self._earlier.union(ranges)
            since = time.time() if since is None else since
            self._earlier_since = since if self._earlier_since is None else min(self._earlier_since, since)
            self._update()

    def pending(self, horizon_s: float) -> tuple[float, RecordRanges] | None:
        """(since when, the records) of an earlier run's committed batches that have not come back to this run,
        for the next batch's offset: a later run that starts from it ACCEPTs them too (on Spark 4.1 a run ends
        with its batch, so records that come back after it would otherwise reach a later batch). None once
        ``horizon_s`` passed since they became pending (by then they came back, or were acknowledged)."""
        with self._lock:
            if self._earlier_since is None or time.time() - self._earlier_since > horizon_s:
                return None
            left = self._earlier.minus(self._returned)
            return (self._earlier_since, left) if left else None

    def accepting(self, batch: int, ranges: RecordRanges) -> None:
        """Batch ``batch`` is committed and its ACCEPTs are about to be sent: a record of it that comes back (its
        lock expired first) is ACCEPTed, not handed out again."""
        with self._lock:
            self._accepting[batch] = ranges
            self._update()

    def accepted(self, batch: int, refused: bool) -> None:
        """The broker answered ``batch``'s ACCEPTs; ``refused``: not all of them went through, so its records
        stay committed (which of them failed is known per partition only; the others never come back)."""
        with self._lock:
            ranges = self._accepting.pop(batch, None)
            if ranges is not None and refused:
                self._kept = self._kept.union(ranges)
            self._update()

    def _update(self) -> None:
        out = self._kept
        for ranges in self._accepting.values():
            out = out.union(ranges)
        self.committed = out

    def replay(self, batch: int, ranges: RecordRanges, hold_s: float = float("inf")) -> None:
        """Batch ``batch`` is replayed with ``ranges``; once a poll brought some of them, the others are waited
        for ``hold_s`` at most (the ones brought are locked meanwhile, and Spark must still process them)."""
        with self._lock:
            self.replays[batch] = ranges
            self._missing[batch] = len(ranges)
            self._hold_s[batch] = hold_s

    def replayed(self, batch: int) -> None:
        with self._lock:
            for d in (self.replays, self._missing, self._hold_s, self._holding_since):
                d.pop(batch, None)

    def waiting(self, batch: int) -> bool:
        """Is ``batch`` being replayed with records no poll has brought yet, and may it wait for them?"""
        since = self._holding_since.get(batch)
        return self._missing.get(batch, 0) > 0 and (
            since is None or time.monotonic() - since < self._hold_s.get(batch, float("inf")))

    def wanted(self, batch: int) -> RecordRanges | None:
        return self.replays.get(batch)

    def sort(self, batch: int, msgs: list) -> tuple[list, list, list]:
        """(the batch's, a committed batch's, the next batch's) of one poll's messages, in their order."""
        committed, wanted = self.committed, self.replays.get(batch)
        if not msgs or (not committed and wanted is None):
            return msgs, [], []
        n, m = len(msgs), type(msgs[0])
        names: dict[str, int] = {}
        codes = np.fromiter((names.setdefault(t, len(names)) for t in map(m.topic, msgs)), np.int64, n)
        parts = np.fromiter(map(m.partition, msgs), np.int64, n)
        offsets = np.fromiter(map(m.offset, msgs), np.int64, n)
        topic_of = {i: t for t, i in names.items()}
        done = np.zeros(n, bool)
        mine = np.ones(n, bool) if wanted is None else np.zeros(n, bool)
        keys = (codes << 32) | parts
        order = np.argsort(keys, kind="stable")
        for at in np.split(order, np.flatnonzero(np.diff(keys[order])) + 1):  # one partition's messages each
            topic, p = topic_of[int(codes[at[0]])], int(parts[at[0]])
            if committed:
                done[at] = committed.mask(topic, p, offsets[at])
            if wanted is not None:
                mine[at] = wanted.mask(topic, p, offsets[at])
        mine &= ~done
        later = ~mine & ~done
        back = None
        if done.any() and self._earlier:
            runs: dict[Partition, list] = {}
            for i in np.flatnonzero(done).tolist():
                runs.setdefault((topic_of[int(codes[i])], int(parts[i])), []).append((int(offsets[i]), int(offsets[i])))
            back = RecordRanges(runs)
        with self._lock:
            self.accepted_again += int(done.sum())
            if back is not None:
                self._returned = self._returned.union(back)
            if batch in self._missing and mine.any():
                self._missing[batch] -= int(mine.sum())
                self._holding_since.setdefault(batch, time.monotonic())
        pick = lambda flags: [msg for msg, f in zip(msgs, flags.tolist()) if f]  # noqa: E731
        return pick(mine), pick(done), pick(later)
