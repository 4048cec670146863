"""Fault matrix: a batch is read more than once (rows 6 and 11).

Row 6: two actions on the batch DataFrame, each with a task that fails once and is retried: every
attempt sees the rows first acquired, nothing extra is acquired (invariant 3). Row 11: re-execution
with ``persist()``: the counts agree and nothing is read twice."""
from __future__ import annotations

import json
import uuid

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    check_no_loss,
    gid,
    ids_of,
    read_stream,
    run_available_now,
    source_progress,
    uid,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row6_two_actions_and_a_task_retry_see_the_same_rows(spark, kafka, tmp_path):
    """Invariant 3: re-reads of a batch return the rows first acquired; nothing extra is acquired."""
    w = Workload(kafka, "events", partitions=2)
    w.produce(400)
    seen_dir = tmp_path / "attempts"
    seen_dir.mkdir()

    def fail_first_attempt(batches):
        from pyspark import TaskContext
        ctx = TaskContext.get()
        offsets = []
        out = []
        for b in batches:
            offsets += list(zip(b.column("partition").to_pylist(), b.column("offset").to_pylist()))
            out.append(b)
        path = seen_dir / f"p{ctx.partitionId()}-a{ctx.attemptNumber()}-{uuid.uuid4().hex[:6]}.json"
        path.write_text(json.dumps(offsets))
        if ctx.attemptNumber() == 0 and offsets:
            # The first attempt of each data-carrying task fails once per action.
            raise RuntimeError("injected task failure downstream of the read")
        yield from out

    counts = {}
    delivered = []

    def two_actions(df, batch_id):
        n = df.count()
        rows = df.collect()
        counts[batch_id] = (n, len(rows), len({(r["partition"], r["offset"]) for r in rows}))
        delivered.extend(ids_of(rows))

    df = read_stream(spark, kafka, kafka.group(uid("g")), w.topic)
    df = df.mapInArrow(fail_first_attempt, df.schema)
    q = spark_share.drain(df.writeStream.foreachBatch(two_actions).option("checkpointLocation", str(tmp_path / "ck"))
         )
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert counts and all(n == m == d for n, m, d in counts.values()), counts
    assert sum(n for n, _, _ in counts.values()) == 400
    # Every attempt at a slot of the data batch (2 actions x failed attempt + retry) saw the same rows.
    slots_with_data = 0
    for slot in (0, 1):
        first = [sorted(map(tuple, json.loads(p.read_text()))) for p in seen_dir.glob(f"p{slot}-a0-*.json")]
        retry = [sorted(map(tuple, json.loads(p.read_text()))) for p in seen_dir.glob(f"p{slot}-a1-*.json")]
        first = [f for f in first if f]
        if not first:
            continue
        slots_with_data += 1
        assert len(first) == 2 and len(retry) == 2, "the injected failures and their retries did not all happen"
        assert first[0] == first[1] == retry[0] == retry[1]
    assert slots_with_data >= 1
    progress = source_progress(q)
    assert progress["acquired"] == 400, "re-reads acquired extra records"
    assert check_no_loss(w.ids, delivered).duplicates == 0


@pytest.mark.both_read_modes
def test_row11_reexecution_with_persist(spark, kafka, tmp_path):
    w = Workload(kafka, "r11", partitions=2)
    w.produce(200)
    counts = []

    def twice(df, batch_id):
        df.persist()
        counts.append((df.count(), len(df.collect())))
        collector(df, batch_id)
        df.unpersist()

    collector = BatchCollector()
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, twice, str(tmp_path / "ck"))
    assert q.exception() is None
    assert all(a == b for a, b in counts)
    assert check_no_loss(w.ids, collector.ids).duplicates == 0
    assert source_progress(q)["acquired"] == 200
