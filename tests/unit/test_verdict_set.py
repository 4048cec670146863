"""``spark_share.verdict_set``: verdicts as columns, their chunks on the wire, each agent's share of them."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from spark_share.acknowledgement import REJECT, RELEASE
from spark_share.errors import VerdictClash
from spark_share.verdict_set import CHUNK_ROWS, VerdictSet, runs_of


def coordinates(rows) -> pa.Table:
    return pa.table({"topic": pa.array([r[0] for r in rows], pa.string()),
                     "partition": pa.array([r[1] for r in rows], pa.int32()),
                     "offset": pa.array([r[2] for r in rows], pa.int64())})


def test_a_row_named_twice_counts_once_and_two_kinds_for_one_row_are_refused():
    vs = VerdictSet.of(coordinates([("t", 0, 5), ("t", 0, 5), ("t", 1, 2)]), REJECT, "bad json")
    assert len(vs) == 2 and vs.records() == [("t", 0, 5, REJECT), ("t", 1, 2, REJECT)]
    with pytest.raises(VerdictClash) as e:
        vs.update(VerdictSet.of(coordinates([("t", 0, 5), ("t", 0, 6)]), RELEASE))
    assert e.value.count == 1 and e.value.rows == [("t", 0, 5)]
    assert len(vs) == 2, "a refused update adds nothing"
    vs.update(VerdictSet.of(coordinates([("t", 0, 6), ("u", 0, 1)]), RELEASE))
    assert sorted(vs.records()) == [("t", 0, 5, REJECT), ("t", 0, 6, RELEASE), ("t", 1, 2, REJECT),
                                    ("u", 0, 1, RELEASE)]


def test_chunks_round_trip_with_reasons_and_stay_under_the_chunk_size():
    n = CHUNK_ROWS * 2 + 7
    table = pa.table({"topic": pa.array(["orders", "audit"] * (n // 2) + ["orders"]),
                      "partition": pa.array(np.arange(n) % 3, pa.int32()),
                      "offset": pa.array(np.arange(n), pa.int64())})
    vs = VerdictSet.of(table, REJECT, "unparseable")
    chunks = vs.chunks()
    assert len(chunks) == 3 and all(pa.ipc.open_stream(c).read_all().num_rows <= CHUNK_ROWS for c in chunks)
    assert max(c.size for c in chunks) < 8 << 20, "a chunk is a few MB: topics and reasons are dictionary-encoded"
    back = VerdictSet.from_chunks(chunks)
    assert len(back) == n
    hit, reasons = back.reasons_for("audit", 1, np.array([1, 7, 2]))
    assert hit.tolist() == [True, True, False] and reasons == ["unparseable", "unparseable"]
    assert VerdictSet().chunks() == [] and len(VerdictSet.from_chunks([])) == 0, "an agent without verdicts gets none"


def test_each_agent_gets_the_verdicts_inside_its_runs_and_the_rest_are_named():
    vs = VerdictSet.of(coordinates([("t", 0, o) for o in (1, 5, 9, 15, 30)]), REJECT)
    a = runs_of([{"offsets": {"t": {"0": [[0, 5]]}}}, {"offsets": {"t": {"0": [[6, 9]]}}}])  # merged: [0, 9]
    b = runs_of([{"offsets": {"t": {"0": [[10, 20]]}}}])
    assert a[("t", 0)][0].tolist() == [0] and a[("t", 0)][1].tolist() == [9]
    assert [r[2] for r in vs.within(a).records()] == [1, 5, 9]
    assert [r[2] for r in vs.within(b).records()] == [15]
    assert vs.outside([a, b]) == (1, [("t", 0, 30)])
    offsets, kinds = vs.kinds_in("t", 0, 5, 15)
    assert offsets.tolist() == [5, 9, 15] and kinds.tolist() == [REJECT] * 3


def test_rejects_an_agent_did_not_write_as_dead_letters_become_releases():
    vs = VerdictSet.from_records([("t", 0, 1, REJECT, "x"), ("t", 0, 2, RELEASE), ("t", 0, 3, REJECT, "y")])
    released = vs.as_kind(RELEASE, vs.of_kind(REJECT))
    assert [k for *_, k in released.records()] == [RELEASE] * 3
    assert [k for *_, k in vs.records()] == [REJECT, RELEASE, REJECT], "the original is left as it was"


def test_two_million_rejects_take_arrays_not_objects():
    n = 2_000_000
    table = pa.table({"topic": pa.array(["orders"] * n), "partition": pa.array(np.arange(n) % 8, pa.int32()),
                      "offset": pa.array(np.arange(n) // 8, pa.int64())})
    vs = VerdictSet.of(table, REJECT, "poison")
    held = sum(p.offsets.nbytes + p.kinds.nbytes + p.reasons.nbytes for p in vs.parts.values())
    assert len(vs) == n and held == n * 13, "8 bytes of offset, 1 of kind, 4 of reason per row"
    half = runs_of([{"offsets": {"orders": {str(p): [[0, n // 16 - 1]] for p in range(8)}}}])
    assert len(vs.within(half)) == n // 2
