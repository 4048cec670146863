"""Per-record verdicts as columns: the rows a user reject()s or release()s, as the driver keeps them and
as they cross between our processes.

Owns: ``VerdictSet``, the (topic, partition, offset, kind, reason) of each record given a verdict, held
per topic-partition as sorted numpy arrays; its Arrow IPC form in chunks of at most ``CHUNK_ROWS`` rows
(what crosses from the user's process to the tracker, and from the tracker to each agent: every frame
stays small, whatever the verdicts); merging two sets with the check that no row gets two kinds; the
part of a set inside offset runs (what one agent acquired: each agent gets only its own); and the kinds
inside one run (what an agent acknowledges).

Shared by the driver and the executor (both below it import nothing of each other).

Must never: hold a Python object per record (two million rejects are arrays, not two million tuples), or
decode anything but Arrow IPC.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .errors import VerdictClash

CHUNK_ROWS = 250_000  # rows per IPC chunk: about 4 MB, far under a frame's bound
COORDINATES = pa.schema([("topic", pa.string()), ("partition", pa.int32()), ("offset", pa.int64())])
_DICT = pa.dictionary(pa.int32(), pa.string())
# On the wire: topics and reasons dictionary-encoded (a few distinct values over millions of rows).
SCHEMA = pa.schema([("topic", _DICT), ("partition", pa.int32()), ("offset", pa.int64()), ("kind", pa.int8()),
                    ("reason", _DICT)])

Partition = tuple[str, int]
Runs = Mapping[Partition, tuple[np.ndarray, np.ndarray]]  # per partition: sorted run starts, their ends


@dataclass
class _Part:
    offsets: np.ndarray  # int64, sorted, unique
    kinds: np.ndarray  # int8
    reasons: np.ndarray  # int32 index into VerdictSet.reasons (-1: none)


class VerdictSet:
    def __init__(self) -> None:
        self.parts: dict[Partition, _Part] = {}
        self.reasons: list[str | None] = []

    def __len__(self) -> int:
        return sum(len(p.offsets) for p in self.parts.values())

    def __bool__(self) -> bool:
        return bool(self.parts)

    # --- making one -----------------------------------------------------------------------------------
    @classmethod
    def of(cls, coordinates: pa.Table, kind: int, reason: str | None = None) -> VerdictSet:
        """The verdict ``kind`` (one ``reason``) for every row of a (topic, partition, offset) table; a row
        named twice counts once."""
        table = coordinates.select(["topic", "partition", "offset"]).append_column(
            "kind", pa.array(np.full(coordinates.num_rows, kind, np.int8)))
        return cls.from_table(table, reason=reason)

    @classmethod
    def from_records(cls, records: Iterable[tuple], kind: int | None = None, reason: str | None = None) -> VerdictSet:
        """From a few (topic, partition, offset[, kind[, reason]]) tuples (poison records, tests)."""
        rows = list(records)
        table = pa.table({"topic": pa.array([r[0] for r in rows], pa.string()),
                          "partition": pa.array([int(r[1]) for r in rows], pa.int32()),
                          "offset": pa.array([int(r[2]) for r in rows], pa.int64()),
                          "kind": pa.array([int(r[3]) if kind is None else kind for r in rows], pa.int8()),
                          "reason": pa.array([(r[4] if len(r) > 4 else None) if reason is None else reason
                                              for r in rows], pa.string())})
        return cls.from_table(table)

    @classmethod
    def from_table(cls, table: pa.Table, reason: str | None = None) -> VerdictSet:
        """From a table of SCHEMA's columns (``reason``: one for every row, instead of the column). Rows
        named twice with the same kind count once; with two kinds it raises ``VerdictClash``."""
        out = cls()
        if table.num_rows == 0:
            return out
        table = table.combine_chunks()
        names, t_idx64 = _codes(table.column("topic"))
        t_idx = t_idx64.astype(np.int64)
        parts = table.column("partition").to_numpy().astype(np.int64)
        offsets = table.column("offset").to_numpy().astype(np.int64)
        kinds = table.column("kind").to_numpy().astype(np.int8)
        if reason is not None or "reason" not in table.column_names:
            out.reasons = [reason]
            r_idx = np.zeros(len(offsets), np.int32)
        else:
            out.reasons, r_idx = _codes(table.column("reason"))
        key = (t_idx << 32) | parts
        order = np.lexsort((offsets, key))
        key, offsets, kinds, r_idx = key[order], offsets[order], kinds[order], r_idx[order]
        same = (key[1:] == key[:-1]) & (offsets[1:] == offsets[:-1])
        if same.any():
            clash = np.flatnonzero(same & (kinds[1:] != kinds[:-1]))
            if len(clash):
                raise VerdictClash([(names[int(key[i] >> 32)], int(key[i] & 0xFFFFFFFF), int(offsets[i]))
                                    for i in clash[:5]], len(clash))
            keep = np.concatenate(([True], ~same))
            key, offsets, kinds, r_idx = key[keep], offsets[keep], kinds[keep], r_idx[keep]
        bounds = np.flatnonzero(np.diff(key)) + 1
        for lo, hi in zip(np.concatenate(([0], bounds)), np.concatenate((bounds, [len(key)]))):
            k = int(key[lo])
            out.parts[(names[k >> 32], k & 0xFFFFFFFF)] = _Part(offsets[lo:hi], kinds[lo:hi], r_idx[lo:hi])
        return out

    # --- as it crosses ---------------------------------------------------------------------------------
    def to_table(self) -> pa.Table:
        if not self.parts:
            return SCHEMA.empty_table()
        names = list(self.parts)
        sizes = [len(self.parts[k].offsets) for k in names]
        reasons = np.concatenate([self.parts[k].reasons for k in names])
        reason_col = pa.DictionaryArray.from_arrays(pa.array(reasons, pa.int32(), mask=reasons < 0),
                                                    pa.array(self.reasons or [None], pa.string()))
        return pa.table({
            "topic": _repeat([t for t, _ in names], sizes),
            "partition": pa.array(np.repeat(np.array([p for _, p in names], np.int32), sizes), pa.int32()),
            "offset": pa.array(np.concatenate([self.parts[k].offsets for k in names]), pa.int64()),
            "kind": pa.array(np.concatenate([self.parts[k].kinds for k in names]), pa.int8()),
            "reason": reason_col}, schema=SCHEMA)

    def chunks(self, rows: int = CHUNK_ROWS) -> list[pa.Buffer]:
        """Arrow IPC streams of at most ``rows`` rows each (none for an empty set)."""
        if not self.parts:  # most agents of most batches: Arrow's empty table costs about a millisecond
            return []
        table = self.to_table()
        out = []
        for at in range(0, table.num_rows, rows):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, SCHEMA) as writer:
                writer.write_table(table.slice(at, rows))
            out.append(sink.getvalue())
        return out

    @classmethod
    def from_chunks(cls, blobs: Iterable) -> VerdictSet:
        out = cls()
        for blob in blobs:
            out.update(cls.from_table(pa.ipc.open_stream(pa.py_buffer(blob)).read_all()))
        return out

    # --- as the driver uses it -------------------------------------------------------------------------
    def update(self, other: VerdictSet) -> None:
        """Add ``other``'s verdicts; a row both name with two kinds raises ``VerdictClash`` and adds nothing."""
        clashes: list[tuple[str, int, int]] = []
        count = 0
        for key, theirs in other.parts.items():
            mine = self.parts.get(key)
            if mine is None:
                continue
            both, i, j = np.intersect1d(mine.offsets, theirs.offsets, assume_unique=True, return_indices=True)
            bad = both[mine.kinds[i] != theirs.kinds[j]]
            count += len(bad)
            clashes += [(key[0], key[1], int(o)) for o in bad[: 5 - len(clashes)]]
        if count:
            raise VerdictClash(clashes, count)
        shift = len(self.reasons)
        self.reasons += other.reasons
        for key, theirs in other.parts.items():
            r = np.where(theirs.reasons >= 0, theirs.reasons + shift, -1).astype(np.int32)
            mine = self.parts.get(key)
            if mine is None:
                self.parts[key] = _Part(theirs.offsets, theirs.kinds, r)
                continue
            offsets = np.concatenate((mine.offsets, theirs.offsets))
            offsets, first = np.unique(offsets, return_index=True)
            self.parts[key] = _Part(offsets, np.concatenate((mine.kinds, theirs.kinds))[first],
                                    np.concatenate((mine.reasons, r))[first])

    def within(self, runs: Runs) -> VerdictSet:
        """The verdicts on records inside ``runs`` (one agent's acquisitions: sorted starts and ends per
        partition, not overlapping)."""
        out = VerdictSet()
        out.reasons = self.reasons
        for key, part in self.parts.items():
            mask = _inside(part.offsets, runs.get(key))
            if mask.any():
                out.parts[key] = _Part(part.offsets[mask], part.kinds[mask], part.reasons[mask])
        return out

    def outside(self, runs_of_all: Iterable[Runs]) -> tuple[int, list[tuple[str, int, int]]]:
        """How many verdicts name records inside none of these runs (and a few of them)."""
        every = list(runs_of_all)
        count, examples = 0, []  # type: tuple[int, list[tuple[str, int, int]]]
        for key, part in self.parts.items():
            held = np.zeros(len(part.offsets), bool)
            for runs in every:
                held |= _inside(part.offsets, runs.get(key))
            missing = part.offsets[~held]
            count += len(missing)
            examples += [(key[0], key[1], int(o)) for o in missing[: 5 - len(examples)]]
        return count, examples

    def of_kind(self, kind: int) -> VerdictSet:
        out = VerdictSet()
        out.reasons = self.reasons
        for key, part in self.parts.items():
            mask = part.kinds == kind
            if mask.any():
                out.parts[key] = _Part(part.offsets[mask], part.kinds[mask], part.reasons[mask])
        return out

    def as_kind(self, kind: int, which: VerdictSet) -> VerdictSet:
        """A copy whose verdicts on the records of ``which`` are ``kind`` instead."""
        out = VerdictSet()
        out.reasons = self.reasons
        for key, part in self.parts.items():
            kinds = part.kinds
            theirs = which.parts.get(key)
            if theirs is not None:
                kinds = np.where(np.isin(part.offsets, theirs.offsets), np.int8(kind), kinds).astype(np.int8)
            out.parts[key] = _Part(part.offsets, kinds, part.reasons)
        return out

    # --- as the agent uses it --------------------------------------------------------------------------
    def kinds_in(self, topic: str, partition: int, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, kinds) of the verdicts on records first..last of a partition."""
        part = self.parts.get((topic, partition))
        if part is None:
            return _EMPTY_OFFSETS, _EMPTY_KINDS
        lo, hi = np.searchsorted(part.offsets, [first, last + 1])
        return part.offsets[lo:hi], part.kinds[lo:hi]

    def reasons_for(self, topic: str, partition: int, offsets: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
        """For offsets of a partition: which have a verdict here (a mask), and their reasons."""
        part = self.parts.get((topic, partition))
        if part is None or not len(offsets):
            return np.zeros(len(offsets), bool), []
        at = np.clip(np.searchsorted(part.offsets, offsets), 0, len(part.offsets) - 1)
        hit = part.offsets[at] == offsets
        return hit, [self.reasons[i] if i >= 0 else None for i in part.reasons[at[hit]]]

    def records(self, limit: int | None = None) -> list[tuple[str, int, int, int]]:
        """(topic, partition, offset, kind) tuples, for messages and tests: small sets only."""
        out = []
        for (t, p), part in self.parts.items():
            out += [(t, p, int(o), int(k)) for o, k in zip(part.offsets, part.kinds)]
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out


_EMPTY_OFFSETS = np.zeros(0, np.int64)
_EMPTY_KINDS = np.zeros(0, np.int8)


def _repeat(values: list[str], sizes: list[int]) -> pa.Array:
    """``values[i]`` ``sizes[i]`` times, dictionary-encoded, without a Python object per row."""
    codes = np.repeat(np.arange(len(values), dtype=np.int32), sizes)
    return pa.DictionaryArray.from_arrays(pa.array(codes), pa.array(values, pa.string()))


def _codes(column) -> tuple[list, np.ndarray]:
    """(distinct values, each row's index into them; -1 for a null) of a string or dictionary column."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not pa.types.is_dictionary(col.type):
        col = col.dictionary_encode()
    return col.dictionary.to_pylist(), col.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int32)


def _inside(offsets: np.ndarray, runs: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray:
    if runs is None or not len(runs[0]):
        return np.zeros(len(offsets), bool)
    starts, ends = runs
    i = np.searchsorted(starts, offsets, side="right") - 1
    return (i >= 0) & (offsets <= ends[np.maximum(i, 0)])


def runs_of(acquired: Iterable[Mapping]) -> dict[Partition, tuple[np.ndarray, np.ndarray]]:
    """The offset runs of acquisitions (``BatchState.acquired`` values: ``{topic: {partition: [[first,
    last], ...]}}``), per partition, sorted, overlapping runs merged."""
    gathered: dict[Partition, list] = {}
    for a in acquired:
        for topic, parts in (a.get("offsets") or {}).items():
            for p, runs in parts.items():
                gathered.setdefault((topic, int(p)), []).extend(runs)
    out = {}
    for key, runs in gathered.items():
        arr = np.array(sorted(runs), np.int64).reshape(-1, 2)
        starts, ends = [int(arr[0, 0])], [int(arr[0, 1])]
        for s, e in arr[1:]:
            if s <= ends[-1] + 1:
                ends[-1] = max(ends[-1], int(e))
            else:
                starts.append(int(s))
                ends.append(int(e))
        out[key] = (np.array(starts, np.int64), np.array(ends, np.int64))
    return out
