"""One batch id, one set of rows (invariant 9), and stops that never hang (invariant 4).

A batch id that cannot be served with the rows it first had (replayed after a restart, already
acknowledged, never planned, or read again after its agent was lost) acquires nothing: Spark and
idempotent sinks assume a replayed id carries the same data, so new records under it would be
ACCEPTed unwritten. And SIGTERM at any moment of latestOffset, planning or acknowledging ACCEPTs
what Spark committed, RELEASEs the rest, removes the runtime files and exits within seconds."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

import spark_share
from spark_share.batches import ACCEPT, REJECT
from spark_share.errors import BatchRefused
from spark_share.options import parse_options
from spark_share.protocol import Acquired, Claim
from spark_share.runtime import agent_socket_path
from spark_share.tracker import AGENT_LOST, Tracker
from support import (
    BatchCollector,
    Workload,
    agent_processes,
    check_no_loss,
    drain_share_group,
    ids_of,
    read_stream,
    registry,
    wait_until,
)

HARNESS = os.path.join(os.path.dirname(__file__), "sigterm_harness.py")


def gid():
    return f"g-{uuid.uuid4().hex[:8]}"


def source_progress(q) -> dict:
    import json

    latest = q.recentProgress[-1]["sources"][0]["latestOffset"]
    return json.loads(latest) if isinstance(latest, str) else latest


class StubAgent(SimpleNamespace):
    """An agent connection for tracker-only tests: records the commands it gets, answers them."""

    def __init__(self, agent_id: str, written=None):
        super().__init__(info={"agent_id": agent_id}, sent=[], closed=False, written=written)

    def call(self, req, blob=b"", timeout=None):
        self.sent.append(req)
        return {"queued": 1}, b""

    def call_async(self, req, blob=b""):
        self.sent.append(req)
        f = Future()
        if req["op"] == "deadletter":
            f.set_result(({"written": len(req["records"]) if self.written is None else self.written}, b""))
        else:
            f.set_result(({"slots": {}}, b""))
        return f

    def wait_closed(self, timeout=None):
        return True


def tracker(kafka, topic, **options) -> Tracker:
    kafka.create_topic(topic, 2)
    return Tracker(parse_options({"kafka.bootstrap.servers": kafka.bootstrap_servers, "kafka.group.id": gid(),
                                  "subscribe": topic, **options}))


def acquired(t: Tracker, agent, batch: int, slot: int, topic: str, partition: int, first: int, last: int) -> None:
    t._acquired(agent, Acquired(batch, slot, rows=last - first + 1, offsets={topic: {str(partition): [[first, last]]}}))


# --- tracker: which reads may acquire, and what a lost agent means ------------------------------------
def test_reads_of_batches_this_run_cannot_serve_are_refused(kafka):
    t = tracker(kafka, "refused")
    a1, a2 = StubAgent("a1"), StubAgent("a2")
    t.agents.update(a1=a1, a2=a2)
    try:
        assert t.batch_to_read(4) is None, "a batch an earlier run planned (a replay) must read nothing"
        with pytest.raises(BatchRefused, match="planned by an earlier run"):
            t._claim(a1, Claim(4, 0))
        with pytest.raises(BatchRefused, match="never planned"):
            t._claim(a1, Claim(9, 0))
        b = t.plan(5, None)
        assert t.batch_to_read(5) is b and t._claim(a1, Claim(5, 0)) == {"owner": "a1"}
        acquired(t, a1, 5, 0, "refused", 0, 0, 9)
        t.batch_committed(5)
        assert b.state == "acked"
        with pytest.raises(BatchRefused, match="already committed"):
            t._claim(a2, Claim(5, 0))
        with pytest.raises(BatchRefused, match="already committed"):
            t._claim(a2, Claim(2, 0))  # older than anything kept: finished long ago
        assert t.total_acquired == 10
    finally:
        t.agents.clear()
        t.shutdown()
    with pytest.raises(BatchRefused, match="stopping"):
        t._claim(a1, Claim(6, 0))
    assert t.plan(6, None) is None


def test_a_slot_whose_agent_is_lost_reads_nothing_new(kafka):
    """Re-reading a slot whose records a lost agent acquired gets no rows (its rows may be in a sink
    already; the broker releases them and they come back later); a slot claimed by a lost agent that
    never acquired anything is polled again (no row of it reached Spark)."""
    t = tracker(kafka, "lost")
    a1, a2, a3 = StubAgent("a1"), StubAgent("a2"), StubAgent("a3")
    t.agents.update(a1=a1, a2=a2, a3=a3)
    try:
        t.plan(0, None)
        assert t._claim(a1, Claim(0, 0)) == {"owner": "a1"}
        acquired(t, a1, 0, 0, "lost", 0, 0, 4)
        assert t._claim(a3, Claim(0, 1)) == {"owner": "a3"}
        del t.agents["a1"], t.agents["a3"]
        assert t._claim(a2, Claim(0, 0)) == {"owner": None}
        assert t._claim(a2, Claim(0, 1)) == {"owner": "a2"}
        t.batch_committed(0)
        assert t.batches[0].outcome.failed == 5 and t.batches[0].outcome.errors == {AGENT_LOST: 5}
    finally:
        t.agents.clear()
        t.shutdown()


def test_agent_lost_while_a_batch_with_rejects_commits(kafka, tmp_path):
    """The live agent writes the dead letters it holds and acknowledges (its REJECT and ACCEPTs); the
    lost agent's records count as failed and come back; the query does not fail naming a target
    that was fine."""
    t = tracker(kafka, "rejects", deadLetterPath=str(tmp_path / "dlq"))
    live, lost = StubAgent("live"), StubAgent("lost")
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, "rejects", 0, 0, 9)
        acquired(t, lost, 0, 1, "rejects", 1, 0, 9)
        t.batches[0].verdicts.update({("rejects", 0, 3): (REJECT, "bad"), ("rejects", 1, 4): (REJECT, "bad")})
        t.batch_committed(0)
        assert t.failure is None
        dead = [r for r in live.sent if r["op"] == "deadletter"]
        assert [d["records"] for d in dead] == [[["rejects", 0, 3, "bad"]]]
        ack = next(r for r in live.sent if r["op"] == "ack")
        assert ack["default"] == ACCEPT and ["rejects", 0, 3, REJECT] in ack["verdicts"]
        o = t.batches[0].outcome
        assert (o.failed, o.errors) == (10, {AGENT_LOST: 10})
    finally:
        t.agents.clear()
        t.shutdown()


def test_a_dead_letter_write_that_finds_fewer_records_still_fails(kafka, tmp_path):
    t = tracker(kafka, "fewer", deadLetterPath=str(tmp_path / "dlq"))
    live = StubAgent("live", written=0)
    t.agents["live"] = live
    try:
        t.plan(0, None)
        acquired(t, live, 0, 0, "fewer", 0, 0, 9)
        t.batches[0].verdicts[("fewer", 0, 3)] = (REJECT, "bad")
        with pytest.raises(Exception, match="deadLetterPath"):
            t.batch_committed(0)
        assert next(r for r in live.sent if r["op"] == "ack")["default"] != ACCEPT
    finally:
        t.agents.clear()
        t.shutdown()


# --- SIGTERM at each phase -------------------------------------------------------------------------
class Lines:
    """The harness's stdout, line by line, read on a thread (select() cannot see lines already buffered)."""

    def __init__(self, proc):
        self.queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [self.queue.put(line) for line in proc.stdout] + [self.queue.put("")],
                         daemon=True).start()

    def wait_for(self, prefix: str, timeout: float = 90.0) -> list:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the harness never printed {prefix!r}") from None
            assert line, f"the harness ended before printing {prefix!r}"
            if line.startswith(prefix):
                return line.split()


def sigterm_to_another_thread(pid: int) -> None:
    """SIGTERM to one of ``pid``'s threads other than its main one: the kernel delivers a signal sent
    to a process to any thread that does not block it, and a handler that only the main thread can
    run waits for it to come back from a blocking read (in the runner: the JVM's socket)."""
    import ctypes

    def blocks_sigterm(tid: int) -> bool:  # librdkafka's threads block every signal
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
        return bool(mask & (1 << (signal.SIGTERM - 1)))

    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    tid = next(t for t in sorted(tids) if not blocks_sigterm(t))
    SYS_tgkill = 234  # x86_64
    assert ctypes.CDLL(None, use_errno=True).syscall(SYS_tgkill, pid, tid, signal.SIGTERM) == 0


@pytest.mark.parametrize("phase", ["latest_offset", "planning", "acknowledging"])
def test_sigterm_at_each_phase_accepts_the_committed_batch_and_releases_the_rest(kafka, phase):
    kafka.set_record_lock_duration(60_000)  # only a release, not an expiry, hands records out in time
    topic, group, query_id = f"term-{phase}", gid(), f"q-{uuid.uuid4().hex[:8]}"
    w = Workload(kafka, topic, partitions=2)
    first = w.produce(100)
    proc = subprocess.Popen([sys.executable, HARNESS, kafka.bootstrap_servers, group, topic, phase, query_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines = Lines(proc)
        _, rows, tracker_id = lines.wait_for("READ")
        assert int(rows) == 100
        second = w.produce(50)  # batch 1's polls acquire these when it is planned
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines.wait_for("PHASE")
        t0 = time.monotonic()
        sigterm_to_another_thread(proc.pid)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(f"SIGTERM at {phase}: the process ended {took:.1f} s later")
    assert took < 12, f"the stop took {took:.1f} s"
    assert registry(query_id) is None, "the query registry file was left behind"
    wait_until(lambda: not agent_processes(tracker_id), timeout=30, message="the agent outlived its tracker")
    assert not os.path.exists(agent_socket_path(tracker_id))
    got = drain_share_group(kafka.bootstrap_servers, group, [topic], timeout=15, until=len(second))
    ids = ids_of({"value": v} for _, _, _, _, v in got)
    # Batch 0 was committed: ACCEPTed, never delivered again. Batch 1 was not: released at once.
    assert not set(ids) & set(first), f"{len(set(ids) & set(first))} records of the committed batch came back"
    assert sorted(ids) == sorted(second)


# --- end to end: a replayed batch, a kept batch DataFrame, the file sink -------------------------
@pytest.fixture
def _register(spark):
    spark_share.register(spark)


def test_a_replayed_batch_reads_nothing_so_an_idempotent_writer_loses_nothing(spark, kafka, tmp_path, _register):
    """foreachBatch counts the batch, skips a batch id it already wrote (Delta's txnAppId/txnVersion)
    and otherwise writes. Run 1 writes batch 0 and fails before Spark's commit: batch 0 is released,
    and another member of the group processes part of it. Spark replays batch 0 after the restart:
    new records under that id would be skipped by the writer and then ACCEPTed (lost)."""
    w = Workload(kafka, "replay", partitions=2)
    w.produce(400)
    group, ck = gid(), str(tmp_path / "ck")
    written = {}  # batch id -> ids: the idempotent writer's table
    crashes = [RuntimeError("crash after the write, before Spark's commit")]

    def idempotent_write(df, batch_id):
        print(f"batch {batch_id}: {df.count()} rows")
        if batch_id in written:
            return
        written[batch_id] = ids_of(df.collect())
        if crashes:
            raise crashes.pop()

    q = (read_stream(spark, kafka, group, "replay").writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="crash after the write"):
        q.awaitTermination(120)
    assert len(written[0]) > 100
    other = drain_share_group(kafka.bootstrap_servers, group, ["replay"], timeout=30, until=100, max_poll_records=100)
    taken = ids_of({"value": v} for _, _, _, _, v in other)
    assert 0 < len(taken) < len(written[0]), "the other member should take part of the released batch"
    w.produce(200)
    q = (read_stream(spark, kafka, group, "replay").writeStream.foreachBatch(idempotent_write)
         .option("checkpointLocation", ck).trigger(availableNow=True).start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    replay = q.recentProgress[0]
    assert (replay["batchId"], replay["numInputRows"]) == (0, 0), "the replayed batch 0 read records"
    sink = [i for ids in written.values() for i in ids]
    report = check_no_loss(w.ids, sink + taken, duplicates_reason="batch 0's rows, written before the crash, "
                           "came back once (to the other member or to a later batch)")
    assert report.duplicates <= len(written[0])


def test_an_action_on_a_batch_after_it_committed_acquires_nothing(spark, kafka, tmp_path, _register):
    """A batch DataFrame kept and read again 25 batches later (as a zombie task attempt would) fails
    clearly and acquires nothing; before, it polled new records under the old batch id and the next
    commit ACCEPTed them unseen."""
    w = Workload(kafka, "kept", partitions=1)
    w.produce(60)
    kept, late = {}, []
    collector = BatchCollector()

    def process(df, batch_id):
        collector(df, batch_id)
        if batch_id == 0:
            kept["df"] = df
        if batch_id == 25:
            try:
                late.append(kept["df"].count())
            except Exception as e:
                late.append(str(e))

    q = (read_stream(spark, kafka, gid(), "kept", maxRecordsPerTrigger=2).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    assert q.awaitTermination(180)
    assert q.exception() is None
    assert len(late) == 1 and isinstance(late[0], str), f"the late action returned {late}"
    assert "already committed and its records acknowledged" in late[0] and "persist()" in late[0], late[0][:2000]
    assert source_progress(q)["acquired"] == 60, "the late action acquired records"
    assert check_no_loss(w.ids, collector.ids).duplicates == 0


def test_the_file_sink_skips_a_replayed_batch_and_loses_nothing(spark, kafka, tmp_path, _register):
    """A crash between the file sink's commit and Spark's commit log (commits/0 removed): Spark
    replays batch 0, the sink skips it without reading, and the records produced meanwhile are
    written by the next batch."""
    w = Workload(kafka, "files", partitions=2)
    w.produce(200)
    group, ck, out = gid(), str(tmp_path / "ck"), str(tmp_path / "out")

    def run(**trigger):
        q = (read_stream(spark, kafka, group, "files").writeStream.format("parquet").option("path", out)
             .option("checkpointLocation", ck).trigger(**trigger).start())
        assert q.awaitTermination(120)
        assert q.exception() is None
        return q

    run(once=True)
    assert sorted(f for f in os.listdir(os.path.join(ck, "commits")) if not f.endswith(".crc")) == ["0"]
    for f in ("0", ".0.crc"):  # the crash: Spark never wrote batch 0's commit (nor its checksum)
        os.unlink(os.path.join(ck, "commits", f))
    w.produce(100)
    q = run(availableNow=True)
    assert q.recentProgress[0]["batchId"] == 0 and q.recentProgress[0]["numInputRows"] == 0
    rows = ids_of(spark.read.parquet(out).collect())
    # Batch 0 was in the commit log when the Trigger.Once run ended: ACCEPTed, not released.
    assert check_no_loss(w.ids, rows).duplicates == 0
