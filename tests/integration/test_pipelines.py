"""Declarative pipelines (``pyspark.pipelines``, Spark >= 4.1): the example pipeline jobs/orders_pipeline, run
with ``spark-pipelines run`` as a user runs it, on the test's broker.

Each update must drain what is queued when it starts and end with exit code 0; every record lands in the
streaming table ``orders``, parsed or marked not valid; what the run wrote is acknowledged (the share group
hands nothing out afterwards); a second update reads only what arrived since; the sink ``invalid_orders``
gets each record that is not an order once; a full refresh leaves the table with what was queued since.
The failures: an update killed in the middle and run again, a broker that cannot be reached, a flow that
fails and is retried by the pipeline.

Spark 4.1 runs a Python source's flow as one batch per update and ends it with no signal spark-share sees: the
update's batch is left in the group (released at its stop) and the next update ACCEPTs it as a batch Spark
committed, never writing it again. There the checks that nothing is left come one update later.
"""
from __future__ import annotations

import glob
import json
import os
import socket
from collections import Counter

import pytest

from harness.pipelines import OrdersPipeline
from harness.support import (
    agent_processes,
    check_no_loss,
    drain_share_group,
    runner_processes,
    uid,
    wait_until,
)
from spark_share import spark_versions

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not spark_versions.PIPELINES, reason="declarative pipelines came with Spark 4.1"),
]
# Spark >= 4.2 runs an update's flow to the end and commits its batches where spark-share sees it; 4.1 does not.
ACKNOWLEDGED_BY_THE_UPDATE = spark_versions.NATIVE_AVAILABLE_NOW


def _orders(ids, bad_every: int = 0) -> list[dict]:
    """Orders with these ids; every ``bad_every``-th has no amount (the quarantine's)."""
    return [{"id": i, "order_id": i, "customer": f"c{i % 7}", **({} if bad_every and i % bad_every == 0
                                                               else {"amount": 1.0 + i % 90})}
            for i in ids]


def _keys(table) -> list[int]:
    return [int(k) for k in table.column("key").to_pylist()] if table.num_rows else []  # str or bytes


def _set_aside(pipeline) -> list[int]:
    """The records the source wrote to the dead-letter directory (maxDeliveryCount reached) and REJECTed."""
    return _keys(pipeline.dead_letters())


def _valid(table, valid: bool) -> set[int]:
    rows = table.to_pylist() if table.num_rows else []
    return {int(r["key"]) for r in rows if r["valid"] is valid}


def _nothing_left(kafka, group: str, topic: str, but: set[int] = frozenset(), update=None) -> None:
    """What the update wrote was acknowledged: the group hands out none of it again (a record the update
    released, or held when its processes ended, is available again and would be in the broker's answer),
    except records of ``but``. The failure shows ``update``'s spark_share log lines, if given."""
    left = [r for r in drain_share_group(kafka, group, [topic], timeout=8.0) if _key_of(r) not in but]
    logs = "".join("\n" + line for line in update.output.splitlines() if "spark_share" in line) if update else ""
    assert not left, (f"{len(left)} records still queued after the update (partitions {sorted({r[1] for r in left})}), "
                      f"e.g. {left[:3]}{logs}")


def _key_of(record) -> int:
    return int(json.loads(record[4])["id"])


# What register() prints where a definitions file calls it: it keeps the static source (a source registered
# from a pipeline's client fails spark-pipelines run after its run: exit 1, UNKNOWN_RESPONSE).
REGISTER_KEPT = "spark_share.register: in a pipeline's definitions file"


@pytest.fixture
def pipeline(kafka, tmp_path, request):
    """The example pipeline; with ``@pytest.mark.register_call``, its definitions call register()."""
    # A killed update's members keep their partitions until the group's session timeout (the embedded broker
    # gives each partition to one member), which a replay waits out: 6 s here. The embedded broker does not
    # say its timeout, so the replay waits a record lock (30 s) there, and with the mock's own default it
    # ended without the partition of one killed member once (Spark 4.1, where the next update's run then
    # ACCEPTs those records: docs/guarantees.md, "Not yet built").
    kafka.set_session_timeout(6000)
    topic = kafka.create_topic(uid("orders"), 4)
    p = OrdersPipeline(str(tmp_path), kafka.bootstrap_servers, kafka.group(uid("pipeline")), topic,
                       register_call=request.node.get_closest_marker("register_call") is not None)
    try:
        yield p
    finally:
        p.stop()


def _invalid_copied(pipeline, invalid: set[int]) -> set[int]:
    """The keys the sink ``invalid_orders`` holds: only records that are not orders, none twice."""
    keys = _keys(pipeline.invalid_orders())
    assert len(keys) == len(set(keys)), f"the sink holds {len(keys) - len(set(keys))} records twice"
    assert set(keys) <= invalid, f"the sink holds orders: {sorted(set(keys) - invalid)[:5]}"
    return set(keys)


@pytest.mark.register_call  # and every update exits 0
def test_each_update_drains_the_queue_and_the_next_reads_only_what_arrived_since(kafka, produce, pipeline):
    topic, group = pipeline.topic, pipeline.group
    first = produce(kafka, topic, _orders(range(1, 601), bad_every=15))
    update = pipeline.run()
    assert update.completed(), f"update 1 failed (exit {update.returncode}):\n{update.output[-4000:]}"
    assert REGISTER_KEPT in update.output, update.output[-3000:]
    orders = pipeline.table("orders")
    assert _set_aside(pipeline) == [], "an update without faults set records aside"
    report = check_no_loss(first, _keys(orders))
    if kafka.external:
        assert report.duplicates == 0, report
    invalid = {i for i in first if i % 15 == 0}
    assert _valid(orders, True) == set(first) - invalid and _valid(orders, False) == invalid
    if ACKNOWLEDGED_BY_THE_UPDATE:  # else by the next update
        _nothing_left(kafka, group, topic)
    copied = _invalid_copied(pipeline, invalid)
    print(f"update 1: produced {len(first)}, read {orders.num_rows}, duplicates {report.duplicates}, "
          f"{len(copied)} of {len(invalid)} not valid in the sink, {update.took:.0f} s")

    second = produce(kafka, topic, _orders(range(601, 901), bad_every=15))
    update = pipeline.run()
    assert update.completed(), f"update 2 failed (exit {update.returncode}):\n{update.output[-4000:]}"
    orders = pipeline.table("orders")
    report2 = check_no_loss(first + second, _keys(orders))
    assert report2.duplicates == report.duplicates, f"update 2 read records of update 1 again: {report2}"
    invalid |= {i for i in second if i % 15 == 0}
    assert _valid(orders, True) == set(first + second) - invalid and _valid(orders, False) == invalid
    if ACKNOWLEDGED_BY_THE_UPDATE:
        _nothing_left(kafka, group, topic)
    copied = _invalid_copied(pipeline, invalid)
    print(f"update 2: produced {len(second)}, read {orders.num_rows - report.delivered}, "
          f"{len(copied)} of {len(invalid)} not valid in the sink, {update.took:.0f} s")

    # Nothing new: the table stays as it is, and the sink catches up with it (its flow may run alongside
    # the table's and see an update's rows one update late).
    update = pipeline.run()
    assert update.completed(), f"update 3 failed (exit {update.returncode}):\n{update.output[-4000:]}"
    assert pipeline.table("orders").num_rows == orders.num_rows, "an update with nothing queued wrote rows"
    assert _invalid_copied(pipeline, invalid) == invalid, "the sink lacks records that are not orders"
    _nothing_left(kafka, group, topic)  # on 4.1: update 3 ACCEPTed update 2's batch when it came back
    print(f"update 3: nothing produced, the sink holds all {len(invalid)}, {update.took:.0f} s")

    # A full refresh empties the table and resets its flow's checkpoint; the share group keeps no
    # history to read again: the table then holds exactly what was queued.
    third = produce(kafka, topic, _orders(range(901, 1001)))
    update = pipeline.run("--full-refresh", "orders")
    assert update.completed(), f"the full refresh failed (exit {update.returncode}):\n{update.output[-4000:]}"
    refreshed = check_no_loss(third, _keys(pipeline.table("orders")))  # and none of the 900 before
    if kafka.external:  # as in the first update: the embedded broker redelivers on a joining consumer
        assert refreshed.duplicates == 0, refreshed
    _nothing_left(kafka, group, topic, but=set() if ACKNOWLEDGED_BY_THE_UPDATE else set(third))
    print(f"full refresh: produced {len(third)}, the table holds {refreshed.delivered}, {update.took:.0f} s")


def _start_until_reading(pipeline) -> None:
    """Start an update and return once Spark wrote its first batch's offsets: the batch's reads acquire
    from then on (in the read tasks, or with readMode=driver as Spark plans it). A kill before that write
    would leave a checkpoint Spark refuses to start from, whatever the source."""
    pipeline.start()
    offsets = os.path.join(pipeline.base, "storage", "**", "offsets", "0")
    wait_until(lambda: glob.glob(offsets, recursive=True) or pipeline.proc.poll() is not None, timeout=240,
               interval=0.05, message="the source's first batch was not planned")
    assert pipeline.proc.poll() is None, f"the update ended before its reads began:\n{pipeline.output()[-3000:]}"


@pytest.mark.register_call
def test_an_update_killed_mid_flow_loses_nothing_when_run_again(kafka, produce, pipeline):
    topic = pipeline.topic
    ids = produce(kafka, topic, _orders(range(1, 4001)))
    _start_until_reading(pipeline)  # killed then: records are acquired, none acknowledged yet
    pipeline.stop()
    wait_until(lambda: not agent_processes() and not runner_processes(), timeout=60,
               message="processes of the killed update were left running")
    killed_rows = pipeline.table("orders").num_rows

    update = pipeline.run()
    assert update.completed(), f"the update after the kill failed (exit {update.returncode}):\n{update.output[-4000:]}"
    if ACKNOWLEDGED_BY_THE_UPDATE:
        _nothing_left(kafka, pipeline.group, topic, update=update)
    # On the embedded broker each consumer that joins ends every share session: the killed update's four
    # joining consumers can bring a partition's records to maxDeliveryCount (4), and they are set aside.
    # Spark 4.1 runs an update's flow as one batch: the rerun is the killed update's batch run again, with the
    # records its polls had acquired (on the embedded broker a consumer still being given its partition can
    # leave one out: 3,001 of 4,000 once in CI), and the next update reads the rest.
    left = set(ids) - set(_keys(pipeline.table("orders"))) - set(_set_aside(pipeline))
    if ACKNOWLEDGED_BY_THE_UPDATE:
        report = check_no_loss(ids, _keys(pipeline.table("orders")), rejected=_set_aside(pipeline),
                               duplicates_reason="a batch the killed update committed but had not acknowledged")
        if kafka.external:  # the embedded broker also redelivers on any client's disconnect (its quirk)
            assert report.duplicates <= killed_rows and not _set_aside(pipeline), report
        print(f"killed update wrote {killed_rows}; after the rerun: {report}")

    # register() in the definitions: the rerun and one more update exit 0; the last reads only what the rerun
    # left (nothing, but on Spark 4.1 what the killed update's batch had not acquired).
    before = _keys(pipeline.table("orders"))
    again = pipeline.run()
    assert again.completed(), f"the update after the rerun failed (exit {again.returncode}):\n{again.output[-4000:]}"
    assert REGISTER_KEPT in update.output and REGISTER_KEPT in again.output, again.output[-3000:]
    after, last = _keys(pipeline.table("orders")), again
    for _ in range(2):  # 4.1: each update is one batch, which a consumer still joining can leave a partition out of
        if ACKNOWLEDGED_BY_THE_UPDATE or set(ids) <= set(after) | set(_set_aside(pipeline)):
            break
        last = pipeline.run()
        assert last.completed(), f"a later update failed (exit {last.returncode}):\n{last.output[-4000:]}"
        after = _keys(pipeline.table("orders"))
    added = Counter(after) - Counter(before)
    assert not Counter(before) - Counter(after), "rows the rerun wrote are gone"
    if kafka.external:  # the embedded broker also redelivers on any client's disconnect (its quirk)
        assert set(added) <= left and max(added.values(), default=1) == 1, \
            f"a later update wrote rows the rerun had written: {sorted(set(added) - left)[:20]}"
    if ACKNOWLEDGED_BY_THE_UPDATE:
        assert len(after) == len(before), "an update with nothing queued wrote rows"
    else:
        report = check_no_loss(ids, after, rejected=_set_aside(pipeline),
                               duplicates_reason="a batch the killed update committed but had not acknowledged")
        print(f"killed update wrote {killed_rows}; the rerun left {len(left)} to the next updates; then: {report}")
        if not added:  # the rerun's batch came back to this update, which ACCEPTed it (4.1: the next update does)
            _nothing_left(kafka, pipeline.group, topic, update=last)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.embedded_only("the unreachable address is a closed local port; the same error on any broker")
def test_an_unreachable_broker_fails_the_update_with_an_error_that_names_it(tmp_path):
    address = f"127.0.0.1:{_closed_port()}"
    # No retries of the failed flow (the pipeline's default is 2): each would fail the same way.
    p = OrdersPipeline(str(tmp_path), address, "g-unreachable", "orders",
                       configuration={"spark.sql.pipelines.maxFlowRetryAttempts": "0"})
    try:
        update = p.run(timeout=240)
    finally:
        p.stop()
    assert update.returncode != 0, "an update against a broker nobody listens on succeeded"
    assert f"kafka.bootstrap.servers='{address}'" in update.output, update.output[-4000:]
    assert "could not reach the Kafka cluster" in update.output, update.output[-4000:]


def test_a_flow_that_fails_mid_batch_is_retried_by_the_pipeline_and_loses_nothing(kafka, produce, pipeline):
    topic = pipeline.topic
    ids = produce(kafka, topic, _orders(range(1, 3001)))
    _start_until_reading(pipeline)
    # The flow's query fails: its source's driver side (the tracker's process) dies mid-batch.
    runners = runner_processes()
    assert runners, "no source runner to kill"
    for r in runners:
        r.kill()
    update = pipeline.wait()
    assert update.completed(), f"the pipeline did not retry the failed flow (exit {update.returncode}):\n" \
                               f"{update.output[-4000:]}"
    last: set[int] = set()
    if not ACKNOWLEDGED_BY_THE_UPDATE:
        # The retried flow ran one batch: the next update reads what it left and ACCEPTs that batch; its own
        # batch waits for the update after it.
        before = set(_keys(pipeline.table("orders")))
        again = pipeline.run()
        assert again.completed(), f"the next update failed (exit {again.returncode}):\n{again.output[-4000:]}"
        last = set(_keys(pipeline.table("orders"))) - before
    report = check_no_loss(ids, _keys(pipeline.table("orders")), rejected=_set_aside(pipeline),
                           duplicates_reason="records the failed flow had acquired, delivered again")
    _nothing_left(kafka, pipeline.group, topic, but=last)
    print(f"after the flow's retry: {report}")
