"""The kafka-share source end to end: a local Spark session against the embedded broker (or a cluster of
yours: tests/harness/brokers.py).

Each test here would fail on the toy design (a consumer in read(), ACCEPT at task end)."""
from __future__ import annotations

import glob
import json
import os
import re
import socket
import threading
import time
import uuid

import pytest

import spark_share
from harness.support import (
    BatchCollector,
    Workload,
    agent_addresses,
    agent_files,
    agent_processes,
    batch_agents,
    check_no_loss,
    drain_share_group,
    gid,
    ids_of,
    kafka_options,
    kill,
    python_workers,
    read_stream,
    registry,
    run_available_now,
    source_progress,
    tracker_log,
    uid,
    wait_until,
)
from spark_share import spark_versions
from spark_share.consumers.agent import CLOSE_WAIT_S
from spark_share.offsets import records_of
from spark_share.runtime import checkpoint_note_path, registry_path, runtime_dir
from spark_share.transport import endpoints, wire


@pytest.mark.both_read_modes
def test_available_now_drains_acknowledges_and_ends(spark, kafka, tmp_path, read_mode):
    w = Workload(kafka, "orders", partitions=2)
    w.produce(600)
    group = kafka.group(uid("g"))
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    df = read_stream(spark, kafka, group, w.topic)
    t0 = time.monotonic()
    q = spark_share.drain(df.writeStream.format("parquet").option("path", out).option("checkpointLocation", ck)
         )
    assert q.awaitTermination(120), "AvailableNow did not end by itself"
    first_run = time.monotonic() - t0
    assert q.exception() is None
    print(f"AvailableNow, 600 records: query start -> end {first_run:.1f} s (a new group's join included: one "
          "share heartbeat on real Kafka, 5 s by default)")
    # The batch that saw the last record was followed by one without tasks (it acknowledges and
    # reports), not by an empty poll.
    assert [p["numInputRows"] for p in q.recentProgress] == [600, 0]
    rows = spark.read.parquet(out).collect()
    report = check_no_loss(w.ids, ids_of(rows))
    assert report.duplicates == 0
    assert {r["deliveryCount"] for r in rows} == {1}
    # The acks were sent before the run ended: the group hands nothing out any more, even though a
    # consumer that never acknowledged would have had its records released when the run stopped.
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == []
    # Per-batch acknowledgement counts show in the progress of the source.
    latest = source_progress(q)
    assert latest["accepted"] == 600 and latest["acquired"] == 600 and latest["failed"] == 0
    # One INFO line per batch, with its counts.
    lines = re.findall(r"spark-share batch (\d+) \(group [^)]+\): acquired (\d+), accepted (\d+)", tracker_log(q))
    # The closing batch (1) acquired nothing: its line is DEBUG, like an idle probe's.
    assert [(int(b), int(n), int(a)) for b, n, a in lines] == [(0, 600, 600)], lines
    # The offsets are small, versioned and carry neither address nor secret: the batch and its run, and with
    # readMode=driver the records the batch acquired (a replay gets them again).
    offset = json.loads(open(os.path.join(ck, "offsets", "0")).read().strip().splitlines()[-1])
    assert set(offset) == {"v", "batch", "run"} | ({"records"} if read_mode == "driver" else set()), offset
    assert (offset["v"], offset["batch"]) == (1, 0), offset
    if read_mode == "driver":
        assert len(records_of(offset)) == 600 and len(offset["records"]) < 200, offset
    assert re.fullmatch(r"[0-9a-f]{16}", offset["run"]) and offset["run"] in tracker_log(q), offset
    # An agent ends once its consumers have closed, which it waits for at most CLOSE_WAIT_S (their releases
    # wait for the broker): the bound here is past that, or a slow close on a busy machine fails the test.
    wait_until(lambda: not agent_processes(), timeout=CLOSE_WAIT_S + 15, message="an agent outlived its query")

    # A second run over the empty queue ends by itself (within awaitTermination's bound) with no rows.
    t0 = time.monotonic()
    q2 = spark_share.drain(read_stream(spark, kafka, group, w.topic).writeStream.format("parquet").option("path", out)
          .option("checkpointLocation", ck))
    assert q2.awaitTermination(60)
    assert q2.exception() is None
    second_run = time.monotonic() - t0
    print(f"AvailableNow: first run {first_run:.1f} s (600 records), second run {second_run:.1f} s (empty)")
    # It ends once a poll of its own answered each partition empty: one empty batch, or a second when the
    # first batch's polls were answered for some partitions only (a member's assignment still coming).
    empty = [p["numInputRows"] for p in q2.recentProgress]
    assert empty and set(empty) == {0} and len(empty) <= 2, empty
    assert spark.read.parquet(out).count() == 600


@pytest.mark.embedded_only("delays the broker's answers (error injection with a round-trip time)")
def test_available_now_drains_a_queue_whose_broker_answers_later_than_its_polls_wait(spark, kafka, tmp_path):
    """Polls that run out of time before the broker answers are not an empty queue: the run goes on
    until it has what was there at its start. (It ended with 0 of 240,000 records when a first fetch
    behind a big backlog outlasted the poll.) The first fetch of each consumer is answered 6 s late:
    the first poll (5 s for a new member) and the next ones (pollTimeoutMs=300) run out of time."""
    w = Workload(kafka, "late", partitions=2)
    w.produce(200)
    collector = BatchCollector()
    kafka.push_broker_request_errors(1, "ShareFetch", [(0, 6000)] * 2)  # no error, 6 s late
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, collector, str(tmp_path / "ck"),
                          pollTimeoutMs=300)
    assert q.exception() is None
    rows = [p["numInputRows"] for p in q.recentProgress]
    assert rows[0] == 0, f"the first poll was answered in time ({rows}): the test proves nothing"
    check_no_loss(w.ids, collector.ids)


def test_consumers_outlive_killed_python_workers(spark, kafka, tmp_path):
    """Invariant 4: killing the Python workers that ran read() loses no consumer and no record."""
    w = Workload(kafka, "clicks", partitions=2)
    w.produce(300)
    killed = []
    agents = []

    def kill_workers_between_actions(df, batch_id):
        first = sorted((r["partition"], r["offset"]) for r in df.collect())
        agents.append({p.pid for p in batch_agents(df)})
        killed.append(kill(python_workers()))
        second = sorted((r["partition"], r["offset"]) for r in df.collect())
        assert first == second
        agents.append({p.pid for p in batch_agents(df)})
        collector(df, batch_id)

    collector = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, kafka.group(uid("g")), w.topic).writeStream
         .foreachBatch(kill_workers_between_actions)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sum(killed) > 0, "no Python worker was killed"
    assert agents[0] and agents[0] == agents[1], "the agent holding the records did not survive"
    report = check_no_loss(w.ids, collector.ids)
    assert report.duplicates == 0


def test_idle_is_cheap_and_latest_offset_answers_from_memory(spark, kafka, tmp_path):
    """Invariant 5/7: no records for 10 s -> at most a couple of batches; latestOffset costs no broker call."""
    topic = kafka.create_topic("quiet", 2)
    collector = BatchCollector()
    ck = str(tmp_path / "ck")
    q = (read_stream(spark, kafka, kafka.group(uid("g")), topic).writeStream.foreachBatch(collector)
         .option("checkpointLocation", ck).start())
    try:
        wait_until(lambda: q.lastProgress is not None, timeout=60, message="query never made progress")
        t0 = time.monotonic()
        first = q.lastProgress["batchId"]
        # Bounded wait of 10 s of idleness, watching the batch counter the whole time.
        batches = set()
        while time.monotonic() - t0 < 10:
            if q.lastProgress:
                batches.add(q.lastProgress["batchId"])
            time.sleep(0.2)
        assert max(batches) - first <= 2, f"{max(batches) - first} batches ran in 10 idle seconds"
        assert collector.rows == []
        # Then records arrive and are picked up promptly (watermarks moved).
        w = Workload(kafka, topic, partitions=2, create=False)
        w.produce(50)
        wait_until(lambda: len(collector.rows) >= 50, timeout=30, message="new records not picked up")
        # Invariant 2: acknowledged promptly once committed (the default trigger).
        wait_until(lambda: spark_share.status(q)["accepted"] == 50, timeout=30, message="records not acknowledged")
        acked = [b for b in spark_share.status(q)["batches"] if b["acquired"]]
        # The commit listener told the tracker where the commit log is (a stop reads it).
        wait_until(lambda: f"commit log {os.path.join(ck, 'commits')}" in tracker_log(q), timeout=10,
                   message="the tracker never learnt where the commit log is")
    finally:
        q.stop()
    for b in acked:
        committed = os.path.getmtime(os.path.join(ck, "commits", str(b.get("sparkBatch", b["batch"]))))
        assert b["ackedAt"] - committed < 1.0, f"batch {b['batch']} acknowledged {b['ackedAt'] - committed:.2f} s after its commit"


def test_latest_offset_makes_no_broker_call(kafka):
    from spark_share.options import parse_options
    from spark_share.reader import ShareStreamReader

    topic = kafka.create_topic("t", 2)
    reader = ShareStreamReader(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group("g"),
                                              "subscribe": topic}))
    start = reader.initialOffset()
    t = reader._t()
    calls = []
    real = t.metadata.client

    class Counting:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if callable(attr):
                def wrapped(*a, **kw):
                    calls.append((name, threading.current_thread().name))
                    return attr(*a, **kw)
                return wrapped
            return attr

    try:
        t.metadata.client = Counting()
        end = reader.latestOffset(start, None)  # the first batch always runs (records may be waiting)
        t.batch_committed(0)
        for _ in range(800):  # ten seconds' worth of default-trigger calls
            assert reader.latestOffset(end, None) == end
            reader.reportLatestOffset()
        assert [c for c in calls if c[1] == threading.current_thread().name] == []
    finally:
        t.metadata.client = real
        reader.stop()
    # The stop came while readMode=driver's in-process agent was still starting (joining, polling batch 0):
    # nothing of it outlives the stop, or its consumers hold what they acquired with nobody to acknowledge it.
    wait_until(lambda: not [th for th in threading.enumerate() if th.name.startswith("share-session-")],
               timeout=CLOSE_WAIT_S + 15, message="share sessions outlived the reader's stop")


def test_an_agent_that_says_hello_once_the_stop_began_is_refused(kafka):
    """An agent whose connection came as the stop began (readMode=driver's starts with the query) is refused:
    admitted, it would hold what its consumers acquire with nobody to acknowledge it. It leaves at once."""
    from spark_share.consumers.agent import Agent
    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options

    topic = kafka.create_topic("late", 1)
    opts = parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()), "subscribe": topic})
    t = Tracker(opts)
    try:
        t.ledger.stopping = True  # the stop's first step; its server still listens
        with pytest.raises(Exception, match=f"tracker {t.tracker_id} is stopping: agent .+ not admitted"):
            Agent(t.address, t.tracker_id, t.secret, opts.consumer_config(), {}, [], serve=False)
        wait_until(lambda: not t.server.connections, timeout=10, message="the refused agent's connection stayed open")
        assert t.agents == {}
        assert not [th for th in threading.enumerate() if th.name.startswith("share-session-")]
    finally:
        t.ledger.stopping = False
        t.shutdown()


def test_available_now_waits_for_records_it_gave_back(kafka):
    # A run whose batch gave records back (released, failed or expired acks) does not end on the
    # first empty batch after it: the redelivery may still be on its way (a fetch in flight).
    from concurrent.futures import Future
    from types import SimpleNamespace

    from spark_share.driver.drain_policy import AVAILABLE_NOW_EMPTY_RETRIES
    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options
    from spark_share.transport.protocol import Acquired

    w = Workload(kafka, "given-back", partitions=1)
    w.produce(10)
    t = Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group("g"),
                               "subscribe": w.topic}))
    verdict = {}  # batch -> what the agent reports its acknowledgement did

    def ack_result(req):  # the agent's answer once the broker confirmed the batch's acknowledgements
        f = Future()
        if req["op"] == "prefetch":  # on one host, planning a batch starts its polls
            f.set_result(({"started": 1}, b""))
            return f
        if req["op"] == "ack":  # queued on the consumers
            f.set_result(({"queued": 1}, b""))
            return f
        assert req["op"] == "ack_result"
        f.set_result(({"slots": {"0": verdict[req["batch"]]}}, b""))
        return f

    agent = SimpleNamespace(info={"agent_id": "a1"}, call_async=ack_result)
    t.agents["a1"] = agent

    def batch(n, rows=0, redelivered=0, **outcome):
        t.plan(n, None)
        verdict[n] = outcome
        if rows:
            t._on_acquired(agent, Acquired(n, 0, rows=rows, redelivered=redelivered,
                                        offsets={w.topic: {"0": [[0, rows - 1]]}}))
        t.batch_committed(n)
        return t.should_run(n)

    try:
        t.prepare_available_now()
        assert batch(0, rows=10, accepted=7, released=3)
        assert [batch(n) for n in range(1, AVAILABLE_NOW_EMPTY_RETRIES + 2)] == \
            [True] * AVAILABLE_NOW_EMPTY_RETRIES + [False]  # bounded: the broker may archive them
        # They come back: nothing left to come back, nothing unseen below the start's watermark. One
        # more batch without tasks acknowledges this one and reports it; it does not poll.
        assert batch(10, rows=3, redelivered=3, accepted=3)
        assert t.plan(11, None).slots == 0 and t.slot_budgets(t.batches[11]) == []
        assert not batch(11)
    finally:
        t.agents.clear()
        t.shutdown()


def test_stop_accepts_a_committed_batch_it_was_not_told_of(kafka, tmp_path):
    """q.stop() can come after Spark wrote a batch to the commit log and before the commit listener
    told the tracker: the tracker finds the batch in the commit log and ACCEPTs it; a batch that is
    not there is RELEASEd."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from spark_share.acknowledgement import ACCEPT, RELEASE
    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options
    from spark_share.transport.protocol import Acquired

    topic = kafka.create_topic("stopping", 1)
    t = Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group("g"),
                               "subscribe": topic}))
    sent = {}

    def ack_result(req):
        f = Future()
        if req["op"] == "ack":
            sent[req["batch"]] = req["default"]
            f.set_result(({"queued": 1}, b""))
        else:
            f.set_result(({"slots": {}}, b""))
        return f

    agent = SimpleNamespace(info={"agent_id": "a1"}, call_async=ack_result,
                            wait_closed=lambda timeout=None: True)
    t.agents["a1"] = agent
    (tmp_path / "commits").mkdir()
    (tmp_path / "commits" / "4").write_text("v1\n{}")  # Spark committed its batch 4
    query_id = uid("q")
    with open(checkpoint_note_path(query_id), "w") as f:  # what the listener notes when the query starts
        json.dump({"root": f"file:{tmp_path}", "runId": "r"}, f)
    try:
        t._serve_query(query_id)
        for n, spark_batch in ((0, 4), (1, 5)):
            t.plan(n, None)
            t.batches[n].spark_batch = spark_batch
            t._on_acquired(agent, Acquired(n, 0, rows=3, offsets={topic: {"0": [[3 * n, 3 * n + 2]]}}))
    finally:
        t.shutdown()
        os.unlink(checkpoint_note_path(query_id))
    assert sent == {0: ACCEPT, 1: RELEASE}


def test_sockets_refuse_peers_without_the_secret(spark, kafka, tmp_path):
    w = Workload(kafka, "secure", partitions=1)
    w.produce(20)
    checks = {}

    def probe(df, batch_id):
        if df.count() == 0:
            return
        qid = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
        reg = registry(qid)
        checks["tracker_host"] = reg["host"]
        checks["registry_mode"] = os.stat(registry_path(qid)).st_mode & 0o777
        checks["dir_mode"] = os.stat(runtime_dir()).st_mode & 0o777
        for secret in ("", "not-the-secret"):
            try:
                endpoints.connect((reg["host"], reg["port"]), secret, timeout=5)
                checks[f"tracker:{secret}"] = "accepted"
            except wire.AuthError:
                checks[f"tracker:{secret}"] = "refused"
        (sock,) = agent_addresses(reg["tracker_id"])  # abstract: no file, so no mode; the handshake admits
        checks["agent_files_in_runtime_dir"] = glob.glob(os.path.join(runtime_dir(), f"agent-{reg['tracker_id']}*"))
        try:
            endpoints.connect(sock, "not-the-secret", timeout=5)
            checks["agent"] = "accepted"
        except wire.AuthError:
            checks["agent"] = "refused"
        ok = endpoints.connect((reg["host"], reg["port"]), reg["secret"], timeout=5)
        checks["status"] = ok.call({"op": "status"}, timeout=10)[0]
        ok.close()

    q = spark_share.drain(read_stream(spark, kafka, kafka.group(uid("g")), w.topic).writeStream.foreachBatch(probe)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert checks["tracker_host"] == "127.0.0.1"
    assert checks["tracker:"] == checks["tracker:not-the-secret"] == checks["agent"] == "refused"
    assert checks["registry_mode"] == 0o600 and checks["dir_mode"] == 0o700
    assert checks["agent_files_in_runtime_dir"] == [], "the agent keeps its files in Spark's local dir"
    assert checks["status"]["inflightRecords"] == 20


@pytest.mark.both_read_modes
def test_two_queries_two_groups_side_by_side(spark, kafka, tmp_path, read_mode):
    wa, wb = Workload(kafka, "ta", partitions=2), Workload(kafka, "tb", partitions=1)
    wa.produce(300)
    wb.produce(200, value_fn=lambda i: json.dumps({"id": 10_000 + i}).encode())
    ca, cb = BatchCollector(), BatchCollector()
    qa = (read_stream(spark, kafka, kafka.group(uid("ga")), wa.topic).writeStream.foreachBatch(ca)
          .option("checkpointLocation", str(tmp_path / "cka")).start())
    qb = (read_stream(spark, kafka, kafka.group(uid("gb")), wb.topic).writeStream.foreachBatch(cb)
          .option("checkpointLocation", str(tmp_path / "ckb")).start())
    try:
        wait_until(lambda: len(ca.rows) >= 300 and len(cb.rows) >= 200, timeout=90, message="queries did not drain")
        ta, tb = registry(qa.id)["tracker_id"], registry(qb.id)["tracker_id"]
        assert ta != tb
        assert bool(agent_processes(ta)) == bool(agent_processes(tb)) == (read_mode == "executors")
        assert {r["topic"] for r in ca.rows} == {wa.topic} and {r["topic"] for r in cb.rows} == {wb.topic}
        ra = check_no_loss(wa.ids, ca.ids, duplicates_reason="the other query's clients connecting (embedded broker)")
        rb = check_no_loss([10_000 + i for i in wb.ids], cb.ids)
        if kafka.external:  # real Kafka: one query's clients never end another's share sessions
            assert ra.duplicates == rb.duplicates == 0, (ra, rb)

        def every_record_accepted() -> bool:
            # On the embedded broker a client of one query connecting can end the other's share sessions
            # (quirk 2): those acknowledgements fail. The records come back: in readMode=driver, for a batch
            # Spark committed, they are ACCEPTed unseen (acceptedAgain); else they reach a later batch.
            sa, sb = spark_share.status(qa), spark_share.status(qb)
            done = lambda s: s["accepted"] + s.get("acceptedAgain", 0)  # noqa: E731
            return sa["inflightRecords"] == sb["inflightRecords"] == 0 and done(sa) == 300 and done(sb) == 200

        wait_until(every_record_accepted, timeout=60, message="not every record of both queries was accepted")
    finally:
        qa.stop()
        qb.stop()


@pytest.mark.both_read_modes
def test_max_records_per_trigger_is_honoured(spark, kafka, tmp_path):
    w = Workload(kafka, "capped", partitions=2)
    w.produce(250)
    collector = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, kafka.group(uid("g")), w.topic, maxRecordsPerTrigger=100).writeStream
         .foreachBatch(collector).option("checkpointLocation", str(tmp_path / "ck"))
         )
    assert q.awaitTermination(120)
    assert q.exception() is None
    sizes = {b: len(rows) for b, rows in collector.batches.items()}
    assert max(sizes.values()) <= 100 and sum(sizes.values()) == 250, sizes
    assert {r["deliveryCount"] for r in collector.rows} == {1}, "excess records were released and redelivered"
    check_no_loss(w.ids, collector.ids)


@pytest.mark.both_read_modes
def test_read_all_available_ignores_max_records_per_trigger_and_num_partitions_sets_tasks(spark, kafka, tmp_path):
    """Trigger.Once asks for ReadAllAvailable: maxRecordsPerTrigger does not apply (Spark's rule for
    admission control; Spark < 4.2 tells a Python source no read limit, and there the source applies
    its own under every trigger). numPartitions=1 reads 4 topic-partitions with one task, into a noop
    sink."""
    w = Workload(kafka, "all", partitions=4)
    w.produce(400)
    tasks = []

    def count_tasks(df, batch_id):
        tasks.append(df.rdd.getNumPartitions())
        collector(df, batch_id)

    collector = BatchCollector()
    q = (read_stream(spark, kafka, kafka.group(uid("g")), w.topic, maxRecordsPerTrigger=50, numPartitions=1).writeStream
         .foreachBatch(count_tasks).option("checkpointLocation", str(tmp_path / "ck")).trigger(once=True).start())
    assert q.awaitTermination(120)
    assert q.exception() is None
    if spark_versions.ADMISSION_CONTROL:
        assert tasks == [1] and len(collector.rows) > 50, (tasks, len(collector.rows))
    else:
        assert tasks == [1] and len(collector.rows) == 50, (tasks, len(collector.rows))
    q = spark_share.drain(read_stream(spark, kafka, kafka.group(uid("g2")), w.topic, numPartitions=1).writeStream.format("noop")
         .option("checkpointLocation", str(tmp_path / "ck2")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sum(p["numInputRows"] for p in q.recentProgress) == 400


def test_two_kafka_share_sources_in_one_query_fail_clearly(spark, kafka, tmp_path):
    """Verdicts and commit signals find a query's tracker by the query id: a second kafka-share
    source in the same query is refused with an error that says what to do instead."""
    wa, wb = Workload(kafka, "ua", partitions=1), Workload(kafka, "ub", partitions=1)
    wa.produce(10)
    wb.produce(10)
    both = read_stream(spark, kafka, kafka.group(uid("g")), wa.topic).unionByName(
        read_stream(spark, kafka, kafka.group(uid("g")), wb.topic))
    q = both.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck")).start()
    with pytest.raises(Exception, match="two kafka-share sources"):
        q.awaitTermination(120)


@pytest.mark.both_read_modes
def test_headers_null_keys_and_large_values(spark, kafka, tmp_path):
    from confluent_kafka import Producer

    topic = kafka.create_topic("odd", 1)
    p = Producer({**kafka.client(), "message.max.bytes": 2_000_000, "log_level": 2})
    p.produce(topic, key=None, value=None)
    p.produce(topic, key=b"", value=b"")
    p.produce(topic, key=b"big", value=b"x" * ((1 << 20) - 1024))  # the broker's limit is 1 MiB per batch
    p.produce(topic, key=b"h", value=b"v", headers=[(f"h{i}", f"v{i}".encode()) for i in range(40)])
    p.flush(30)
    collector = BatchCollector()
    q = spark_share.drain(read_stream(spark, kafka, kafka.group(uid("g")), topic, includeHeaders="true").writeStream
         .foreachBatch(collector)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(120)
    assert q.exception() is None
    rows = sorted(collector.rows, key=lambda r: r["offset"])
    assert [r["offset"] for r in rows] == [0, 1, 2, 3]
    assert rows[0]["key"] is None and rows[0]["value"] is None
    assert bytes(rows[1]["key"]) == b"" and bytes(rows[1]["value"]) == b""
    assert len(rows[2]["value"]) == (1 << 20) - 1024
    assert len(rows[3]["headers"]) == 40 and rows[3]["headers"][7]["key"] == "h7"
    assert bytes(rows[3]["headers"][7]["value"]) == b"v7"


def test_bad_setup_fails_fast_with_a_clear_error(spark, kafka, tmp_path):
    exists, missing = kafka.create_topic("exists", 1), kafka.name("missing-topic")
    q = (read_stream(spark, kafka, kafka.group(uid("g")), f"{exists},{missing}").writeStream.format("noop")
         .option("checkpointLocation", str(tmp_path / "ck1")).start())
    with pytest.raises(Exception, match=re.escape(missing)):
        q.awaitTermination(60)
    # An unreachable broker is an error naming it, never a hang.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    df = (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", dead)
          .option("kafka.group.id", "g").option("subscribe", "t").load())
    t0 = time.monotonic()
    q = df.writeStream.format("noop").option("checkpointLocation", str(tmp_path / "ck2")).start()
    with pytest.raises(Exception, match=dead.replace(".", r"\.")):
        q.awaitTermination(90)
    assert time.monotonic() - t0 < 30
    with pytest.raises(Exception, match="subscribePattern"):
        (spark.readStream.format("kafka-share").option("kafka.bootstrap.servers", dead)
         .option("kafka.group.id", "g").option("subscribePattern", "t.*").load())


@pytest.mark.both_read_modes
def test_secrets_never_leak(spark, kafka, tmp_path):
    secret, key_secret = "S3cr3t-Pa55-" + uuid.uuid4().hex[:6], "KeyPa55-" + uuid.uuid4().hex[:6]
    if {"sasl.username", "sasl.password", "ssl.key.password"} & set(kafka.client()):
        pytest.skip("its made-up credentials would replace the cluster's own (from SPARK_SHARE_TEST_KAFKA_OPTIONS)")
    w = Workload(kafka, "sec", partitions=1)
    w.produce(20)
    opts = {"kafka.sasl.username": "alice", "kafka.sasl.password": secret, "kafka.ssl.key.password": key_secret}
    texts = []

    def fail_second(df, batch_id):
        texts.append(repr(df.count()))
        if batch_id >= 1:
            raise RuntimeError("failing run")

    ck = str(tmp_path / "ck")
    q = run_available_now(spark, kafka, kafka.group(gid()), w.topic, lambda df, b: df.count(), ck, **opts)
    texts.append(json.dumps([json.loads(p.json) for p in q.recentProgress]))
    w.produce(5)
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, **opts).writeStream.foreachBatch(fail_second)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception) as e:
        q.awaitTermination(120)
    texts.append(str(e.value))
    texts.append(json.dumps([json.loads(p.json) for p in q.recentProgress]))
    from spark_share.options import parse_options
    from spark_share.partitions import SharePartition
    from spark_share.reader import ShareStreamReader
    reader = ShareStreamReader(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group("g"),
                                              "subscribe": w.topic, **opts}))
    texts += [repr(reader.opts), str(reader.opts), repr(SharePartition("h", 1, "t", secret, 0, 0, None, 1))]
    agent_logs = agent_files(spark, "agent-*.log*")
    assert agent_logs, "no agent log to search"
    paths = [os.path.join(d, f) for root in (ck, runtime_dir()) for d, _, names in os.walk(root) for f in names]
    for path in paths + agent_logs:
        try:
            texts.append(open(path, errors="replace").read())
        except OSError:
            pass
    blob = "\n".join(texts)
    assert "failing run" in blob  # the failing run's text is part of what was searched
    assert secret not in blob and key_secret not in blob


def test_a_batch_planned_before_the_agent_joined_is_polled_when_it_joins(kafka, monkeypatch):
    """Spark plans the first batch within milliseconds of the runner's start, before this host's agent
    (started with the query) has joined: the tracker asks the agent for the batch's polls when it says
    hello, rather than leaving them to the read tasks."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options
    from spark_share.transport.protocol import Hello

    monkeypatch.delenv("SPARK_SHARE_MASTER", raising=False)  # local mode: one host
    topic = kafka.create_topic("early", 2)
    t = Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()),
                               "subscribe": topic, "numPartitions": "2"}))
    sent: list[dict] = []

    def call_async(req):
        sent.append(req)
        f = Future()
        f.set_result(({"polling": 0}, b""))
        return f

    try:
        b = t.plan(0, None)
        assert b is not None and b.slots == 2
        assert sent == [], "a prefetch went nowhere: no agent had joined"
        t._on_hello(SimpleNamespace(info={}, call_async=call_async, set_keepalive=lambda s: None), Hello("a1", "vm", 1))
        assert [(r["op"], r["batch"], r["count"]) for r in sent] == [("prefetch", 0, 2)]
    finally:
        t.agents.clear()
        t.shutdown()
