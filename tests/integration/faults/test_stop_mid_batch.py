"""Fault matrix: the query is stopped in the middle of a batch (rows 2 and 16).

Row 2: ``q.stop()`` while a batch holds records RELEASEs them at once and leaves no agent, tracker
process or connection behind; a restart delivers everything. Row 16: SIGTERM to the reader's runner
at each phase (latestOffset, planning, acknowledging; run in ``sigterm_harness.py``) ACCEPTs the batch
Spark committed and RELEASEs the rest."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
from pyspark.sql import functions as F

import spark_share
from harness.support import (
    Workload,
    agent_addresses,
    agent_processes,
    check_no_loss,
    drain_share_group,
    gid,
    ids_of,
    read_stream,
    registry,
    uid,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.mark.both_read_modes
def test_row2_stop_mid_batch_releases_at_once_and_leaves_nothing_running(spark, kafka, tmp_path, read_mode):
    """Invariant 5: q.stop() in the middle of a batch RELEASEs its records; no agent stays behind.
    Then a restart from the checkpoint (replaying the uncommitted batch) delivers everything."""
    kafka.set_record_lock_duration(60_000)  # only a release, not lock expiry, can hand them out in time
    w = Workload(kafka, "jobs", partitions=2)
    w.produce(200)
    group, ck, out = kafka.group(uid("g")), str(tmp_path / "ck"), str(tmp_path / "out")

    @F.udf("long")
    def slow(offset):
        time.sleep(0.05)
        return offset

    df = read_stream(spark, kafka, group, w.topic)
    q = (df.withColumn("o2", slow("offset")).writeStream.format("parquet").option("path", out)
         .option("checkpointLocation", ck).start())
    wait_until(lambda: q.isActive and spark_share.status(q)["inflightRecords"] > 0
               if registry(q.id) else False, timeout=60, message="the batch never started")
    reg = registry(q.id)
    tracker_id = reg["tracker_id"]
    assert bool(agent_processes(tracker_id)) == (read_mode == "executors")  # readMode=driver: none, ever
    held = spark_share.status(q)["inflightRecords"]
    t0 = time.monotonic()
    q.stop()
    wait_until(lambda: not agent_processes(tracker_id), timeout=30, message="agent left running after stop")
    wait_until(lambda: not psutil.pid_exists(reg["pid"]), timeout=30, message="the tracker's process outlived the query")
    # Nothing of this process still talks to the tracker (status() and the listener opened connections).
    wait_until(lambda: not [c for c in psutil.Process().net_connections("tcp")
                            if c.raddr and c.raddr.port == reg["port"]], timeout=10,
               message="a connection to the stopped query's tracker was left open")
    # Another member of the group gets the records well before the 60 s lock would expire. (It must
    # join after the query's consumers left: the embedded broker gives a partition to one member.)
    got = drain_share_group(kafka, group, [w.topic], timeout=20, until=200,
                            ack=__import__("confluent_kafka").AcknowledgeType.RELEASE)
    assert len({(t, p, o) for t, p, o, _, _ in got}) >= held, f"only {len(got)} of {held} records released in time"
    assert time.monotonic() - t0 < 40
    assert registry(q.id) is None
    assert not agent_addresses(tracker_id), "an agent still listens"

    # Restart: replays the uncommitted batch and then drains the rest.
    kafka.set_record_lock_duration(30_000)
    q = spark_share.drain(read_stream(spark, kafka, group, w.topic).writeStream.format("parquet").option("path", out)
         .option("checkpointLocation", ck))
    assert q.awaitTermination(120)
    assert q.exception() is None
    report = check_no_loss(w.ids, ids_of(spark.read.parquet(out).collect()),
                           duplicates_reason="rows the stopped batch wrote before the stop")
    if read_mode == "driver":  # the restart ran the stopped batch id again with its own records
        assert report.duplicates == 0, report


HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sigterm_harness.py")


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
def test_row16_sigterm_at_each_phase_accepts_the_committed_batch_and_releases_the_rest(kafka, phase):
    kafka.set_record_lock_duration(60_000)  # only a release, not an expiry, hands records out in time
    group, query_id = kafka.group(gid()), f"q-{uuid.uuid4().hex[:8]}"
    w = Workload(kafka, f"term-{phase}", partitions=2)
    topic = w.topic
    first = w.produce(100)
    proc = subprocess.Popen([sys.executable, HARNESS, group, topic, phase, query_id],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(kafka.client()) + "\n")  # on stdin, not argv: it may hold credentials
        proc.stdin.flush()
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
    assert not agent_addresses(tracker_id), "an agent still listens"
    got = drain_share_group(kafka, group, [topic], timeout=15, until=len(second))
    ids = ids_of({"value": v} for _, _, _, _, v in got)
    # Batch 0 was committed: ACCEPTed, never delivered again. Batch 1 was not: released at once.
    assert not set(ids) & set(first), f"{len(set(ids) & set(first))} records of the committed batch came back"
    assert sorted(ids) == sorted(second)
