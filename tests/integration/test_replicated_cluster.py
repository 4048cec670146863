"""The fault users meet most: a broker of a replicated cluster dies under a running query. Three KRaft
nodes of the kit on loopback (tests/harness/kafka_kit.py: topics and internal topics with replication factor 3,
min.insync.replicas 2); each node in turn is killed with SIGKILL mid-stream and started again, so the
leader of a partition the query reads, the group coordinator and the share coordinator each die once.
Nothing is lost; a record comes twice only as the same record (topic, partition, offset) delivered
again; records produced after each kill arrive within a record lock duration."""
from __future__ import annotations

import time

import pytest

from harness.brokers import ExternalKafka
from harness.kafka_kit import KitCluster
from harness.support import BatchCollector, PacedProducer, Workload, check_no_loss, gid, read_stream, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.real_only("starts a three-node cluster of the kit")]

LOCK_S = 30  # Kafka's default record lock: the stream must be back within it


@pytest.fixture(scope="module")
def three_nodes(broker_choice):
    if broker_choice.start_script is None:
        pytest.skip("starts its own three-node cluster: needs SPARK_SHARE_TEST_KAFKA_START")
    with KitCluster(broker_choice.start_script, nodes=3) as kit:
        yield kit


def _leader(kafka: ExternalKafka, topic: str, partition: int) -> int:
    from confluent_kafka.admin import AdminClient

    md = AdminClient(kafka.client()).list_topics(topic=topic, timeout=10)
    return md.topics[topic].partitions[partition].leader


def test_each_node_killed_in_turn_under_a_running_query(spark, three_nodes, tmp_path):
    with ExternalKafka(three_nodes.bootstrap_servers, kit=three_nodes) as kafka:
        w = Workload(kafka, "replicated", partitions=4)
        group = kafka.group(gid())
        collector = BatchCollector()
        w.produce(400)
        q = (read_stream(spark, kafka, group, w.topic).writeStream.foreachBatch(collector)
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime="1 second").start())
        feeder = PacedProducer(w, 40, 0.25)
        recoveries = []
        try:
            wait_until(lambda: collector.has_all(w.ids[:400]) or not q.isActive, timeout=120,
                       message="the first records did not arrive")
            feeder.start()
            first = _leader(kafka, w.topic, 0)
            order = [first] + [n for n in (1, 2, 3) if n != first]
            for node_id in order:
                node = three_nodes.node(node_id)
                node.kill()
                killed = time.monotonic()
                mark = len(w.ids)  # records produced from here on came after the kill
                wait_until(lambda: len(w.ids) > mark + 40 or not q.isActive, timeout=60,
                           message="the producer stalled after the kill")
                after = list(w.ids[mark:mark + 40])
                wait_until(lambda: collector.has_all(after) or not q.isActive, timeout=2 * LOCK_S,
                           interval=0.2, message=f"records produced after node {node_id} was killed did not arrive")
                recoveries.append((node_id, time.monotonic() - killed))
                node.start()
            assert not feeder.stop()
            wait_until(lambda: collector.has_all(w.ids) or not q.isActive, timeout=180,
                       message="not every record arrived after the nodes came back")
            assert q.isActive and q.exception() is None, q.exception()
        finally:
            feeder.stop()
            q.stop()
        report = check_no_loss(w.ids, collector.ids, duplicates_reason="acknowledgements a broker's death cut off")
        where: dict[bytes, tuple] = {}
        for r in collector.rows:
            key, at = bytes(r["value"]), (r["partition"], r["offset"])
            assert where.setdefault(key, at) == at, f"the producer wrote {key!r} twice"
        print(f"three nodes, each killed in turn (leader of partition 0 first: node {first}): records produced "
              "after each kill arrived " + ", ".join(f"node {n}: {s:.1f} s" for n, s in recoveries) + f"; {report}")
        assert all(s < LOCK_S for _, s in recoveries), recoveries
