"""A share group's member limit (Kafka's ``group.share.max.size``, 200 by default), on the embedded broker
(its own limit, the same GROUP_MAX_SIZE_REACHED) and on a real broker started with a small limit.

Tried as a user would, on Kafka 4.2.1 with ``group.share.max.size=2``, a drain with 4 read slots failed after
7.6 s having read nothing, with a read task's ``GROUP_MAX_SIZE_REACHED`` naming neither the setting nor the
fix. Now a query reads on with the members the group admits (and says so), or, admitted none, fails at
once naming the setting, the members it wanted and how to fix it; it never holds more members than its
read slots (``numPartitions``), whichever hosts Spark reads on."""
from __future__ import annotations

import os
import threading
import time

import pytest

import spark_share
from harness import cluster_runs
from harness.brokers import ExternalKafka
from harness.kafka_kit import KitCluster
from harness.support import (
    BatchCollector,
    IdleMember,
    ShareGroups,
    Workload,
    check_no_loss,
    gid,
    ids_of,
    read_stream,
)

pytestmark = pytest.mark.slow

MAX_MEMBERS = "group.share.max.size"


@pytest.fixture
def limited(kafka, broker_choice):
    """``limited(n)``: a broker whose share groups admit ``n`` members: the test's embedded broker, or a broker
    started from the real pass's start script with that setting (a cluster of yours keeps its own: skipped)."""
    kits = []

    def make(members: int):
        if not kafka.external:
            kafka.set_max_members(members)
            return kafka
        if broker_choice.start_script is None:
            pytest.skip(f"starts a broker with {MAX_MEMBERS}={members}: needs one the harness starts (KAFKA_HOME)")
        kit = KitCluster(broker_choice.start_script, props={MAX_MEMBERS: str(members)}).start()
        kits.append(kit)
        return ExternalKafka(kit.bootstrap_servers, kit=kit)

    try:
        yield make
    finally:
        for kit in kits:
            kit.close()


class MemberCount:
    """The group's members as the embedded broker knows them, sampled until ``stop()`` (the most at once)."""

    def __init__(self, kafka, group: str):
        self.most = 0
        self._stop = threading.Event()
        self._groups = ShareGroups(kafka) if not kafka.external else None
        self._group = group
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self._groups is not None and not self._stop.wait(0.05):  # a sampling interval, not a sync
            self.most = max(self.most, len(self._groups.members(self._group)))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.most


def test_a_group_that_admits_none_of_the_querys_members_fails_it_at_once_naming_the_limit(spark, limited, tmp_path):
    """The group is full with another consumer: the query cannot read at all, and says why within
    seconds (was: a misleading fatal error from a read task, after retries)."""
    kafka = limited(1)
    topic = kafka.create_topic("full", 2)
    group = kafka.group(gid())
    other = IdleMember(kafka, group, topic)  # the group's one member
    try:
        Workload(kafka, topic, partitions=2, create=False).produce(100)
        t0 = time.monotonic()
        q = spark_share.drain(read_stream(spark, kafka, group, topic).writeStream
                              .foreachBatch(BatchCollector()).option("checkpointLocation", str(tmp_path / "ck")))
        with pytest.raises(Exception) as e:
            q.awaitTermination(120)
        took = time.monotonic() - t0
    finally:
        other.close()
    message = str(e.value)
    print(f"failed after {took:.1f} s: {message[:3000]}")
    assert took < 60
    # The default numPartitions is one per partition (2), bounded by the group's limit where the broker
    # says it (a real Kafka: 1); the embedded broker does not say.
    asked = 1 if kafka.external else 2
    assert MAX_MEMBERS in message and f"asked for {asked} (numPartitions)" in message and "admitted none" in message
    assert "Raise group.share.max.size on the brokers" in message


def test_a_query_of_more_slots_than_the_group_admits_reads_everything_with_the_members_it_got(namespace_cluster,
                                                                                                   limited):
    """Four read slots on three hosts, a group that admits two members: the query reads every record with
    two, says so in its log and status, and never holds more than the group admits. A real Kafka says its
    limit, and the query refuses at the start a numPartitions above it, naming both (the embedded broker
    does not say: the query learns it from the refusals)."""
    kafka = limited(2)
    w = Workload(kafka, "capped", partitions=4)
    for _ in range(12):  # small sends: a fetch hands out whole record batches
        w.produce(100)
    group = kafka.group(gid())
    shared = os.path.join(namespace_cluster.shared, f"capped-{gid()}")
    count = MemberCount(kafka, group)
    app = cluster_runs.run_app(namespace_cluster, kafka, "drain", w.topic, group, shared, "--partitions", "4")
    try:
        res = cluster_runs.result(app, shared, 600)
    finally:
        most = count.stop()
    if kafka.external:
        assert res["error"] and "option 'numPartitions' = 4" in res["error"] and MAX_MEMBERS in res["error"] \
            and "have 2 members at most" in res["error"], res["error"]
        return
    assert res["error"] is None, res["error"]
    rows = cluster_runs.written(shared)
    check_no_loss(w.ids, ids_of(rows), duplicates_reason="the embedded broker ends every share session when a member "
                                                         "joins or leaves (members moved between hosts)")
    seen = [s for s in res["samples"] if s.get("members") is not None]
    limits = {s["memberLimit"] for s in seen}
    refused = max(s["membersRefused"] for s in seen)
    log = cluster_runs.host_logs(namespace_cluster, "driver", "tracker-")
    print(f"members: at most {most} on the broker, {max(s['members'] for s in seen)} as the tracker counts them; "
          f"limits {sorted(limits)}, {refused} refused")
    assert refused >= 1 and 2 in limits, "the group's refusal was not noticed"
    assert max(s["members"] for s in seen) <= 4 and most <= 2
    assert MAX_MEMBERS in log and "reads on with the 2 the group admitted" in log
