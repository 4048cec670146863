"""Batches fill the lock budget: partitions x the records each partition may have in flight."""
from __future__ import annotations

import re

import pytest

from harness.support import Workload, check_no_loss, gid, id_col, run_available_now, source_progress, tracker_log


def test_a_backlog_fills_the_lock_budget(spark, kafka, tmp_path):
    """Batches fill partitions x the records each partition may have in flight. Embedded: 8 x 4,000 set
    per test, more than the 10,000 a poll took before polls were sized from the budget. Real Kafka: the
    broker's own limit (group.share.partition.max.record.locks, read by the source), 8 x 2,000 on the
    harness's broker. Once the group has settled, a batch of the backlog holds all of it.

    Until its next heartbeat the first member to join believes it holds every partition, and its
    first fetch may take locks on the other member's partitions too. The heartbeat is shortened so that
    window closes while the agent's sessions settle, and the backlog is two budgets and more, so a batch
    after it is full even if a loaded machine stretches the window past the first."""
    partitions = 8
    if kafka.external:
        options, said = {}, "from the broker's group.share.partition.max.record.locks"
        kafka.set_heartbeat_interval(1000)  # the broker's floor (group.share.min.heartbeat.interval.ms)
    else:
        locks = 4000
        kafka.set_max_record_locks(locks)
        kafka.set_heartbeat_interval(250)
        options, said = {"maxRecordLocks": locks}, "from option maxRecordLocks"
    w = Workload(kafka, "budget", partitions=partitions)
    w.produce(72_000 if not kafka.external else 36_000)
    sizes: dict[int, int] = {}
    seen: list[int] = []

    def count(df, batch_id):
        ids = [r[0] for r in df.select(id_col()).collect()]
        sizes[batch_id] = len(ids)
        seen.extend(ids)

    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, count, str(tmp_path / "ck"),
                          numPartitions=2, **options)
    assert q.exception() is None
    m = re.search(r"record locks per partition: (\d+), (from [^:]+):", tracker_log(q))
    assert m and m.group(2) == said, m and m.group(0)
    locks = int(m.group(1))
    assert source_progress(q)["lockBudget"] == locks * partitions
    batches = [sizes[b] for b in sorted(sizes) if sizes[b]]
    assert max(batches) >= 0.9 * locks * partitions, f"batch sizes {batches}"
    # Real Kafka acquires whole record batches ("can be exceeded for alignment of batch boundaries"), its
    # own cap included: a batch may pass the budget by about a producer batch per partition.
    slack = 1.25 if kafka.external else 1.0
    assert max(batches) <= slack * locks * partitions, f"more than the broker lets the group hold: {batches}"
    check_no_loss(w.ids, seen)


@pytest.mark.embedded_only("asserts the fallback for a broker that does not answer DescribeConfigs, as only the "
                           "embedded broker does not")
def test_without_the_option_the_budget_is_kafkas_default_when_the_broker_does_not_say(spark, kafka, tmp_path):
    """The embedded broker does not implement DescribeConfigs: the source falls back to Kafka's
    default of 2,000 per partition and says so."""
    w = Workload(kafka, "budget-default", partitions=3)
    w.produce(300)
    seen: list[int] = []
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic,
                          lambda df, _b: seen.extend(r[0] for r in df.select(id_col()).collect()),
                          str(tmp_path / "ck"))
    assert q.exception() is None
    assert source_progress(q)["lockBudget"] == 3 * 2000
    assert "record locks per partition: 2000, from Kafka's default (the broker did not say" in tracker_log(q)
    check_no_loss(w.ids, seen)
