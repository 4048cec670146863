"""Fault matrix: an agent is lost (row 5, and rows 17 and 18 with a stub agent).

Row 5: the agent is SIGKILLed between the read and the commit: its records come back to a new
agent, counted as failed (AGENT_LOST). Rows 17 and 18 drive the tracker with stub agent connections:
a lost agent while a batch with rejects commits (the live agent dead-letters and acknowledges its
own records; the query does not fail), and a rejected record two agents held (dead-lettered and
REJECTed by the live one only). The last test pins the tracker's rule that a slot whose agent is
lost reads nothing new."""
from __future__ import annotations

from collections import Counter

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    batch_agents,
    check_no_loss,
    gid,
    ids_of,
    kill,
    read_stream,
    tracker_log,
    wait_until,
)
from spark_share.acknowledgement import ACCEPT, REJECT
from spark_share.driver.acks import AGENT_LOST
from spark_share.transport.protocol import Claim

from .helpers import StubAgent, acquired, give, tracker

pytestmark = pytest.mark.slow


def test_row5_agent_killed_while_holding_records(spark, kafka, tmp_path):
    """The agent is SIGKILLed after the batch was read and before it committed: its records go
    back to the group (released when its connections drop, or when their 10 s locks expire) and are
    delivered again to a new agent. (The new agent's consumers join while one of them may already hold
    records of the next batch: its lock must outlast their join, up to JOIN_GRACE_S.)"""
    kafka.set_record_lock_duration(10_000)
    kafka.set_session_timeout(6000)  # the dead agent's members leave the group (and its partitions) sooner
    w = Workload(kafka, "r5", partitions=2)
    w.produce(200)
    killed = []

    def kill_agent(df, batch_id, rows):
        if batch_id == 0:
            killed.append(kill(batch_agents(df)))

    collector = BatchCollector(after=kill_agent)
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, idleProbeIntervalMs=1000).writeStream
         .foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")).start())
    try:
        wait_until(lambda: collector.has_all(w.ids) and 0 in collector.batches
                   and Counter(collector.ids) >= Counter(2 * ids_of(collector.batches[0])),
                   timeout=60, message="batch 0's records did not all come back after the agent died")
        first = len(collector.batches[0])
        wait_until(lambda: spark_share.status(q)["failed"] == first, timeout=30, message="loss not counted")
    finally:
        q.stop()
    assert killed == [1]
    report = check_no_loss(w.ids, collector.ids, duplicates_reason="batch 0's records, redelivered after the agent died")
    assert report.duplicates == first
    assert "AGENT_LOST" in tracker_log(q)


def test_row17_agent_lost_while_a_batch_with_rejects_commits(kafka, tmp_path):
    """The live agent writes the dead letters it holds and acknowledges (its REJECT and ACCEPTs); the
    lost agent's records count as failed and come back; the query does not fail naming a target
    that was fine."""
    t, topic = tracker(kafka, "rejects", deadLetterPath=str(tmp_path / "dlq"))
    live, lost = StubAgent("live"), StubAgent("lost")
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, topic, 0, 0, 9)
        acquired(t, lost, 0, 1, topic, 1, 0, 9)
        give(t.batches[0], (topic, 0, 3, REJECT, "bad"), (topic, 1, 4, REJECT, "bad"))
        t.batch_committed(0)
        assert t.failure is None
        assert live.dead_letters() == [[[topic, 0, 3, "bad"]]], "each agent writes only the rejects it holds"
        (default, verdicts), = live.acks()
        assert default == ACCEPT and verdicts == [[topic, 0, 3, REJECT]], "each agent gets only its verdicts"
        o = t.batches[0].outcome
        assert (o.failed, o.errors) == (10, {AGENT_LOST: 10})
    finally:
        t.agents.clear()
        t.shutdown()


def test_row18_a_rejected_record_two_agents_held_is_dead_lettered_by_the_live_one(kafka, tmp_path):
    """Found by the 60-minute chaos run (11 records lost): an agent is killed mid-batch after its slot
    was read; the broker hands the records it held to another agent, which reads them for another
    slot of the same batch; the application rejects them. The tracker asked only the first holder
    (the lost agent) to write the dead letters, and the live one REJECTed them unwritten. Now every
    live holder writes them, and an agent REJECTs only what it wrote itself."""
    t, topic = tracker(kafka, "twice", deadLetterPath=str(tmp_path / "dlq"))
    lost, live = StubAgent("lost"), StubAgent("live")
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, lost, 0, 0, topic, 0, 0, 9)  # read first, then its agent was killed
        acquired(t, live, 0, 1, topic, 0, 0, 9)  # the same records, released by the broker, read again
        give(t.batches[0], (topic, 0, 3, REJECT, "bad"))
        t.batch_committed(0)
        assert t.failure is None
        assert live.dead_letters() == [[[topic, 0, 3, "bad"]]], "the live holder must write it"
        (default, verdicts), = live.acks()
        assert default == ACCEPT and [topic, 0, 3, REJECT] in verdicts
        assert t.batches[0].outcome.errors == {AGENT_LOST: 10}
    finally:
        t.agents.clear()
        t.shutdown()


def test_a_slot_whose_agent_is_lost_reads_nothing_new(kafka):
    """Re-reading a slot whose records a lost agent acquired gets no rows (its rows may be in a sink
    already; the broker releases them and they come back later); a slot claimed by a lost agent that
    never acquired anything is polled again (no row of it reached Spark)."""
    t, topic = tracker(kafka, "lost")
    a1, a2, a3 = StubAgent("a1"), StubAgent("a2"), StubAgent("a3")
    t.agents.update(a1=a1, a2=a2, a3=a3)
    try:
        t.plan(0, None)
        assert t._on_claim(a1, Claim(0, 0))["owner"] == "a1"
        acquired(t, a1, 0, 0, topic, 0, 0, 4)
        assert t._on_claim(a3, Claim(0, 1))["owner"] == "a3"
        del t.agents["a1"], t.agents["a3"]
        assert t._on_claim(a2, Claim(0, 0))["owner"] is None
        assert t._on_claim(a2, Claim(0, 1))["owner"] == "a2"
        t.batch_committed(0)
        assert t.batches[0].outcome.failed == 5 and t.batches[0].outcome.errors == {AGENT_LOST: 5}
    finally:
        t.agents.clear()
        t.shutdown()
