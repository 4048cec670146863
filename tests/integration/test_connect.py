"""Spark Connect (Databricks serverless, standard access mode): the source driven from a Connect
client, against a Connect server this module starts (one for the module: a JVM costs seconds).

Under Connect, foreachBatch runs in a Python process of the server's, and the jobs it triggers carry
neither the query id nor the batch id; the tests check that verdicts, prompt acknowledgement,
status, stop and restart behave as in classic mode, and that nothing is lost. The foreachBatch
functions write what they saw as Parquet (they cannot append to a list in the test's process).
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import pyarrow.parquet as pq
import pytest

import spark_share
from harness import support
from harness.spark_hosts import private_tmp_command
from harness.support import (
    Workload,
    agent_processes,
    check_no_loss,
    check_tens_rejected,
    drain_share_group,
    gid,
    ids_of,
    kafka_options,
    long_trigger,
    parquet_rows,
    runner_processes,
    summary_count,
    wait_until,
)
from spark_share import runtime, spark_versions
from spark_share.errors import VerdictError

pytestmark = pytest.mark.slow

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory):
    """A Spark Connect server (local[2,2]) as a process of its own, like start-connect-server.sh;
    its Python processes import spark_share and this suite's helpers."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    port = _free_port()
    log_path = tmp_path_factory.mktemp("connect") / "server.log"
    env = dict(os.environ, SPARK_HOME=home, PYSPARK_PYTHON=sys.executable,
               PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "integration"), TESTS]))
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [os.path.join(home, "bin", "spark-submit"), "--class",
             "org.apache.spark.sql.connect.service.SparkConnectServer", "--master", "local[2,2]",
             "--conf", f"spark.connect.grpc.binding.port={port}", "--conf", "spark.ui.enabled=false",
             "--conf", "spark.sql.shuffle.partitions=2", "--conf", "spark.sql.streaming.stopTimeout=60s",
             "--driver-memory", "1g", "spark-internal"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def up():
            if server.poll() is not None:
                raise AssertionError(f"the Connect server exited ({server.returncode}): "
                                     + log_path.read_text()[-3000:])
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                return True
            except OSError:
                return False

        wait_until(up, timeout=180, interval=0.5, message="the Connect server did not start")
        yield f"sc://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


@pytest.fixture(scope="module")
def remote(connect_url):
    """A Connect client session with kafka-share registered, as a user of Databricks would have."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    session = ConnectSession.builder.remote(connect_url).create()
    spark_share.register(session)
    try:
        yield session
    finally:
        session.stop()


def _read(remote, kafka, group, topic, **options):
    r = (remote.readStream.format("kafka-share").options(**kafka_options(kafka))
         .option("kafka.group.id", group).option("subscribe", topic))
    for k, v in {"readMode": support.READ_MODE, **options}.items():
        r = r.option(k, str(v))
    return r.load()


def _parquet_ids(path) -> list[int]:
    return ids_of(_parquet_rows(path, ["value"]))


def _parquet_rows(path, columns) -> list[dict]:
    return parquet_rows(path, columns)


def _json_lines(path) -> list[dict]:
    return [json.loads(line) for f in sorted(glob.glob(os.path.join(str(path), "*.json")))
            for line in open(f) if line.strip()]


@pytest.mark.both_read_modes
def test_verdicts_in_foreach_batch_on_the_server(remote, kafka, tmp_path):
    """reject() and release() in foreachBatch, unchanged user code: dead letters with reasons, released
    rows come back, AvailableNow drains and ends, nothing lost."""
    w = Workload(kafka, "orders", partitions=2)
    ids = w.produce(400)
    out, dlq, seen = str(tmp_path / "out"), str(tmp_path / "dlq"), str(tmp_path / "seen")

    def process(batch, batch_id):
        from pyspark.sql import functions as F

        import spark_share

        rows = batch.withColumn("id", F.get_json_object(F.col("value").cast("string"), "$.id").cast("long"))
        # a DataFrame, and a list of Rows (collected here): both forms of the classic API
        spark_share.reject(rows.where("id % 10 = 0"), reason="tens")
        spark_share.reject(rows.where("id % 10 = 5").collect(), reason="fives")
        spark_share.release(rows.where("id % 10 = 1 AND deliveryCount = 1"))
        keep = rows.where("id % 5 != 0 AND NOT (id % 10 = 1 AND deliveryCount = 1)")
        keep.drop("id").write.mode("append").parquet(out)
        os.makedirs(seen, exist_ok=True)
        with open(os.path.join(seen, f"{batch_id}.json"), "w") as f:
            f.write(json.dumps({"batch": batch_id, "rows": rows.count(), "session": batch.sparkSession.session_id}))

    group = kafka.group(gid())
    q = spark_share.drain(_read(remote, kafka, group, w.topic, deadLetterPath=dlq).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(180), "AvailableNow did not end under Spark Connect"
    assert q.exception() is None, q.exception()
    written = _parquet_ids(out)
    dead = _parquet_rows(dlq, ["value", "reason"])
    dead_ids = {json.loads(bytes(r["value"]))["id"]: r["reason"] for r in dead}
    assert dead_ids == {i: ("tens" if i % 10 == 0 else "fives") for i in ids if i % 5 == 0}
    assert sorted(written) == sorted(i for i in ids if i % 5 != 0), "a written row is missing or twice"
    check_no_loss(ids, written, list(dead_ids))
    batches = _json_lines(seen)
    assert sum(b["rows"] for b in batches) == 400 + 40, "each id%10=1 record is read twice (released once)"
    assert len({b["session"] for b in batches}) == 1, "one Connect session per query run"
    assert drain_share_group(kafka, group, [w.topic], timeout=3) == [], "records left behind"


def test_prompt_acknowledgement_and_status_from_the_client(remote, kafka, tmp_path, monkeypatch):
    """A long processingTime trigger and a 10 s lock: a committed batch is acknowledged within about a second,
    by the listener that runs on the server; status() and lastProgress show it from the client."""
    kafka.set_record_lock_duration(10_000)
    w = Workload(kafka, "slow", partitions=2)
    w.produce(100)
    marks = str(tmp_path / "marks")

    def process(batch, batch_id):
        import time as _time

        rows = batch.count()
        os.makedirs(marks, exist_ok=True)
        with open(os.path.join(marks, f"{batch_id}.json"), "w") as f:
            f.write(json.dumps({"batch": batch_id, "rows": rows, "done": _time.time()}))

    q = (_read(remote, kafka, kafka.group(gid()), w.topic).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(processingTime=long_trigger()).start())
    try:
        first = wait_until(lambda: [m for m in _json_lines(marks) if m["batch"] == 0], timeout=90,
                           message="the first batch never ran")[0]
        # The progress event follows the commit; the server's listener acknowledges on it.
        progress = wait_until(lambda: q.lastProgress, timeout=10, message="no progress from the server")
        status = spark_share.status(q)
        assert status["tracker"] and status["batch"] == 0
        acked = wait_until(lambda: _acked_batch(remote, q, 0), timeout=5,
                           message="acknowledgements waited for the next trigger under Spark Connect")
        # All 100 on one heartbeat; at Kafka's default 5 s heartbeat the second consumer's partition may
        # come after the first batch, whose rows are then fewer (the rest wait for the next trigger).
        assert acked["accepted"] == first["rows"] > 0 and acked.get("expired", 0) == 0, (acked, first)
        print(f"acknowledged {acked['ackedAt'] - first['done']:.2f} s after foreachBatch returned")
        assert acked["ackedAt"] - first["done"] < 2.0, acked
        assert progress["batchId"] == 0
        # A client on another host (here: a runtime directory without the tracker's entry) sees the
        # counts of the last progress, as of that batch's planning.
        other_host = tmp_path / "elsewhere"
        other_host.mkdir(mode=0o700)
        monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(other_host))
        if not spark_versions.ADMISSION_CONTROL:  # Spark < 4.2: the progress carries no source counters
            with pytest.raises(VerdictError, match=rf"this Spark \({re.escape(spark_versions.VERSION_TEXT)}\) "
                                                   "reports no source counters.*spark-share status"):
                spark_share.status(q)
            return
        seen = spark_share.status(q)
        assert seen["view"] == "lastProgress" and seen["sparkBatch"] == 0 and seen["tracker"] == status["tracker"]
        assert {"acquired", "accepted", "released", "rejected", "lockDurationMs"} <= set(seen)
        assert "batches" not in seen  # the full status needs the tracker
    finally:
        q.stop()


def _acked_batch(remote, q, batch: int):
    """The tracker's summary of ``batch`` once acknowledged (the server runs on this host, so the
    client's status() reaches the tracker itself)."""
    st = spark_share.status(q)
    return next((b for b in st.get("batches", []) if b["batch"] == batch and b["state"] == "acked"), None)


def test_default_trigger_into_a_file_sink_and_status_needs_progress(remote, kafka, tmp_path):
    """The default trigger into a Parquet sink (no foreachBatch): every record lands and is accepted;
    status() of a query that is not kafka-share says so."""
    w = Workload(kafka, "plain", partitions=2)
    ids = w.produce(200)
    out = str(tmp_path / "out")
    q = (_read(remote, kafka, kafka.group(gid()), w.topic).writeStream.format("parquet").option("path", out)
         .option("checkpointLocation", str(tmp_path / "ck")).start())

    def committed_ids() -> list[int]:  # the files of committed batches, from the sink's own log
        files = []
        for log in glob.glob(os.path.join(out, "_spark_metadata", "[0-9]*")):
            files += [json.loads(line)["path"].removeprefix("file://") for line in open(log).read().splitlines()[1:]
                      if line.strip()]
        return ids_of(r for f in files for r in pq.read_table(f, columns=["value"]).to_pylist())

    try:
        wait_until(lambda: len(committed_ids()) >= 200, timeout=120, message="the file sink did not get every row")
        assert check_no_loss(ids, committed_ids()).duplicates == 0

        def accepted():
            try:
                return spark_share.status(q)["accepted"]
            except VerdictError:  # before the first progress event
                return None

        wait_until(lambda: accepted() == 200, timeout=30, message="the rows in the file sink were not acknowledged")
    finally:
        q.stop()
    other = remote.readStream.format("rate").load().writeStream.format("noop").start()
    try:
        wait_until(lambda: other.lastProgress is not None, timeout=60, message="no progress")
        with pytest.raises(VerdictError, match="no kafka-share progress"):
            spark_share.status(other)
    finally:
        other.stop()


def test_bad_verdicts_are_the_classic_errors(remote, kafka, tmp_path):
    from pyspark.sql import Row

    w = Workload(kafka, "bad", partitions=1)
    w.produce(10)
    topic = w.topic
    with pytest.raises(VerdictError, match="inside foreachBatch"):
        spark_share.reject([Row(topic=topic, partition=0, offset=1)])
    errs = str(tmp_path / "errs")

    def process(batch, batch_id):
        from pyspark.sql import Row

        import spark_share
        from spark_share.errors import VerdictError

        if batch.count() == 0:
            return
        found = {}
        for name, call in {
            "columns": lambda: spark_share.reject(batch.select("value")),
            "foreign": lambda: spark_share.reject([Row(topic=topic, partition=0, offset=999),
                                                   Row(topic=topic, partition=0, offset=0)]),
            "both": lambda: (spark_share.reject(batch.where("offset = 1")),
                             spark_share.release(batch.where("offset = 1"))),
        }.items():
            try:
                call()
                found[name] = None
            except VerdictError as e:
                found[name] = str(e)
        os.makedirs(errs, exist_ok=True)
        with open(os.path.join(errs, f"{batch_id}.json"), "w") as f:
            f.write(json.dumps(found))

    q = spark_share.drain(_read(remote, kafka, kafka.group(gid()), topic).writeStream.foreachBatch(process)
         .option("checkpointLocation", str(tmp_path / "ck")))
    assert q.awaitTermination(180)
    assert q.exception() is None
    found = _json_lines(errs)[0]
    assert "lack the column(s) ['topic', 'partition', 'offset']" in found["columns"]
    assert "1 of 2 rows are not from batch" in found["foreign"]
    assert "already given the opposite verdict" in found["both"]

    def not_ours(batch, batch_id):  # foreachBatch of a query that does not read kafka-share
        from pyspark.sql import Row

        import spark_share
        from spark_share.errors import VerdictError

        try:
            spark_share.reject([Row(topic="bad", partition=0, offset=1)])
            error = None
        except VerdictError as e:
            error = str(e)
        os.makedirs(errs, exist_ok=True)
        with open(os.path.join(errs, "rate.json"), "w") as f:
            f.write(json.dumps({"not_ours": error}))

    q = (remote.readStream.format("rate").option("rowsPerSecond", 5).load().writeStream.foreachBatch(not_ours)
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120)
    (found,) = [e for e in _json_lines(errs) if "not_ours" in e]
    assert "not from the batch being processed by a running kafka-share query" in found["not_ours"]
    assert "SPARK_SHARE_RUNTIME_DIR" in found["not_ours"]


def _replay_missing(query_id: str) -> int:
    """Records the replays of query ``query_id``'s runs reported missing (the trackers run on this host)."""
    return sum(int(n) for path in support.query_tracker_logs(query_id)
               for n in re.findall(r"(\d+) of its \d+ records were not delivered to this query again", open(path).read()))


def _write_once(batch, batch_id, root) -> None:
    """An idempotent sink, as Delta's txnVersion makes one: ``root/batch_id=N`` written once, a batch id it
    has skipped (on the server, which shares this host's file system)."""
    final = os.path.join(root, f"batch_id={batch_id}")
    if not os.path.exists(final):
        batch.write.parquet(final + ".tmp")
        os.rename(final + ".tmp", final)


@pytest.mark.both_read_modes
def test_failure_stop_and_restart_lose_nothing(remote, kafka, tmp_path, read_mode):
    """foreachBatch raises after writing its batch (the query fails, the rows come back); a restart
    from the checkpoint goes on; a stop mid-batch releases what the batch held. Each batch goes to an
    append sink and to an idempotent one: with readMode=driver Spark's replays of the failed and the stopped
    batch carry the same records, so the idempotent sink gets every record once (but for what a replay
    reports missing: it comes in a later batch)."""
    w = Workload(kafka, "jobs", partitions=2)
    ids = w.produce(300)
    out, marks, group, ck = str(tmp_path / "out"), str(tmp_path / "marks"), kafka.group(gid()), str(tmp_path / "ck")
    once = str(tmp_path / "once")

    def failing(batch, batch_id):
        batch.write.mode("append").parquet(out)
        _write_once(batch, batch_id, once)
        raise RuntimeError("injected failure after the sink write")

    q = (_read(remote, kafka, group, w.topic, maxRecordsPerTrigger=100).writeStream.foreachBatch(failing)
         .option("checkpointLocation", ck).start())
    with pytest.raises(Exception, match="injected failure"):
        q.awaitTermination(180)
    first = _parquet_ids(out)
    assert first, "the failing batch wrote nothing"

    def slow(batch, batch_id):
        import time as _time

        batch.write.mode("append").parquet(out)
        _write_once(batch, batch_id, once)
        os.makedirs(marks, exist_ok=True)
        open(os.path.join(marks, f"{batch_id}.json"), "w").write(json.dumps({"batch": batch_id}))
        if batch_id == 2:
            _time.sleep(600)  # the test stops the query in here

    q = (_read(remote, kafka, group, w.topic, maxRecordsPerTrigger=100).writeStream.foreachBatch(slow)
         .option("checkpointLocation", ck).start())
    wait_until(lambda: any(m["batch"] == 2 for m in _json_lines(marks)), timeout=120,
               message="the restarted query never reached batch 2")
    q.stop()
    assert not q.isActive
    stopped = wait_until(lambda: runtime.read_json(runtime.final_counts_path(str(q.id))), timeout=30,
                         message="the stopped run's tracker left no final counts")  # the server runs on this host
    assert stopped["letGoOfBatch"] is not None, f"the stopped run held records at its end: {stopped}"

    q = spark_share.drain(_read(remote, kafka, group, w.topic).writeStream
         .foreachBatch(lambda batch, batch_id: (batch.write.mode("append").parquet(out),
                                                _write_once(batch, batch_id, once)))
         .option("checkpointLocation", ck))
    assert q.awaitTermination(180)
    report = check_no_loss(ids, _parquet_ids(out), duplicates_reason="the failed batch and the stopped one "
                           "were written, then redelivered")
    assert report.duplicates >= len(first), "the failed batch's rows were not delivered again"
    idempotent = check_no_loss(ids, _parquet_ids(once))
    if read_mode == "driver":
        # What a replay did not get back (its tracker names and counts them) comes in a later batch: only those
        # reach the idempotent sink twice. The embedded broker showed it once in CI (50 of a replay's 100).
        missing = _replay_missing(str(q.id))
        assert idempotent.duplicates == missing, f"a replayed batch carried other records: {idempotent}, " \
                                                 f"{missing} reported missing by the replays"
    final = wait_until(lambda: (lambda f: f if f and f["tracker"] != stopped["tracker"] else None)(
        runtime.read_json(runtime.final_counts_path(str(q.id)))), timeout=30, message="the drain left no final counts")
    assert final["waitedForLockedRecords"] is False, \
        "the stopped run let go of everything it held: the drain that replays its batch waits for no lock"


@pytest.mark.both_read_modes
def test_a_client_that_shares_no_file_system_with_the_server(connect_url, kafka, tmp_path):
    """The client in a mount namespace of its own, with an empty /tmp and none of our environment variables
    (a notebook in Databricks' sandbox): the tracker's registry and runtime directory are out of its view.
    Verdicts in foreachBatch (which the server runs), the commit listener (on the server) and status() (from
    the query's progress) do not need them: every record read, the rejected ones dead-lettered, 0 lost,
    nothing left queued or running."""
    w = Workload(kafka, "sandboxed", partitions=2)
    ids = w.produce(300)
    out, group = str(tmp_path / "out"), kafka.group(gid())
    stage = tempfile.mkdtemp(prefix="connect-client-stage-", dir="/var/tmp")
    try:
        cmd = private_tmp_command([sys.executable, os.path.join(TESTS, "integration", "connect_client_app.py"),
                                    "--remote", connect_url, "--bootstrap", kafka.bootstrap_servers, "--topic",
                                    w.topic, "--group", group, "--read-mode", support.READ_MODE, "--out", out,
                                    "--checkpoint", str(tmp_path / "ck")], stage)
        if cmd is None:
            pytest.skip("a mount namespace of the client's own needs root and unshare")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_SHARE_")}
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        os.rmdir(stage)  # the namespace's mounts on it ended with the client
    line = next((x for x in run.stdout.splitlines() if x.startswith("CLIENT ")), None)
    assert run.returncode == 0 and line, f"the client failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    seen = json.loads(line[len("CLIENT "):])
    assert seen["mountNamespace"] != os.readlink("/proc/self/ns/mnt"), "the client shared the server's mounts"
    assert seen["ended"] and seen["exception"] is None, seen
    # The run's tracker kept its files in the server's /tmp, where the client saw nothing of ours.
    wait_until(lambda: runtime.read_json(runtime.final_counts_path(seen["queryId"])), timeout=30,
               message="the run's tracker left no final counts in the server's runtime directory")
    assert not any(n.startswith("spark-share") for n in seen["tmp"]), f"the client saw our files: {seen['tmp']}"

    check_tens_rejected(kafka, group, w.topic, ids, out, seen)
    wait_until(lambda: not agent_processes() and not runner_processes(), timeout=60,
               message="the query's processes were left running on the server")


@pytest.mark.embedded_only("the job runs the embedded demo")
def test_the_job_runs_against_a_connect_server(connect_url, tmp_path):
    """jobs/queue_to_table.py against a Connect server: the scheduled job as a Spark Connect client (its foreachBatch
    runs on the server, so its summary is counted from the progress and the tables)."""
    job_file = os.path.join(os.path.dirname(TESTS), "jobs", "queue_to_table.py")
    # SPARK_REMOTE, as `spark-submit --remote` sets it (--remote on the job's command line does the same)
    out = subprocess.run([sys.executable, job_file, "--records", "1500", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                         env=dict(os.environ, SPARK_REMOTE=connect_url))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout

    def count(label):
        return summary_count(text, label)

    written_rows = _parquet_rows(tmp_path / "orders", ["status", "deliveryCount"])
    pending = [r for r in written_rows if r["status"] == "pending"]
    said = f"{text[-3000:]}\n{out.stderr[-3000:]}"  # the job's output, to read a failure by
    assert count("produced") == 1500, said
    assert count("written") == len(written_rows) and count("written") + count("rejected") == 1500, said
    # released comes from the rows Spark read: each pending order is released once, then written
    assert count("released") == len(pending) > 0, (len(pending), said)
    assert [r["deliveryCount"] for r in pending if r["deliveryCount"] != 2] == [], said
    assert count("records read") == 1500 + len(pending), (len(pending), said)
    assert count("duplicates in table") == 0, said
    assert re.search(r"^batch 0: read \d+", text, re.M), said


@pytest.mark.parametrize("how", ["--remote", "SPARK_REMOTE"])
def test_the_job_refuses_a_master_and_a_remote_together(tmp_path, how):
    root = os.path.dirname(TESTS)
    raw = json.load(open(os.path.join(root, "conf", "local.json")))
    cfg = tmp_path / "c.json"  # beside the schema file it names
    cfg.write_text(json.dumps(dict(raw, spark_master="local[2]")))
    shutil.copy(os.path.join(root, "conf", "orders.schema.ddl"), tmp_path)
    job_file = os.path.join(root, "jobs", "queue_to_table.py")
    url = "sc://127.0.0.1:1"
    args = ["--remote", url] if how == "--remote" else []
    env = dict(os.environ, SPARK_REMOTE=url) if how == "SPARK_REMOTE" else None
    out = subprocess.run([sys.executable, job_file, "--config", str(cfg), *args],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2 and "'spark_master'" in out.stderr and how in out.stderr, out.stderr


# --- the tracker's side, without a server ------------------------------------------------------------
def test_job_tags_name_the_connect_session():
    from spark_share.connect import session_of_job_tags

    sid = "0b9c3c1e-52f4-4d8a-9a57-3d0d8f1e2a7b"
    tags = f"spark-connect,SparkConnect_OperationTag_User_alice_Session_{sid}_Operation_9f1c8e2a-1b2c-4d5e-8f90-a1b2c3d4e5f6"
    assert session_of_job_tags(tags) == sid
    assert session_of_job_tags("my-tag,other") is None and session_of_job_tags(None) is None


def test_verdicts_find_their_batch_by_connect_session(kafka):
    """Under Connect a verdict names no batch: the tracker picks the batch its reads ran for in that
    session (the latest still being processed); a tracker without one answers no match and records
    nothing; rows of another batch are refused as in classic mode."""
    import uuid
    from concurrent.futures import Future
    from types import SimpleNamespace

    import pyarrow as pa

    from spark_share.acknowledgement import REJECT, RELEASE
    from spark_share.driver.tracker import Tracker
    from spark_share.options import parse_options
    from spark_share.transport.protocol import Acquired, Claim, Verdicts
    from spark_share.verdict_set import VerdictSet

    topic = kafka.create_topic("by-session", 1)
    t = Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()), "subscribe": topic}))
    conn = SimpleNamespace(info={"agent_id": "a1"})
    done = Future()
    done.set_result(({"queued": 0}, b""))
    t.agents["a1"] = SimpleNamespace(info={"agent_id": "a1"}, call_async=lambda req: done)  # takes prefetches
    mine, other = "11111111-2222-3333-4444-555555555555", "66666666-7777-8888-9999-000000000000"
    try:
        for n in (0, 1):
            t.plan(n, None)
            assert t._on_claim(conn, Claim(n, 0, connect_session=mine))["owner"] == "a1"
            t._on_acquired(conn, Acquired(n, 0, rows=5, offsets={topic: {"0": [[n * 5, n * 5 + 4]]}}))
        def verdicts(kind, offset, session, reason=None):
            rows = pa.table({"topic": [topic], "partition": pa.array([0], pa.int32()),
                             "offset": pa.array([offset], pa.int64())})
            (chunk,) = VerdictSet.of(rows, REJECT if kind == "reject" else RELEASE, reason).chunks()
            return t._on_verdicts(conn, Verdicts(None, kind, uuid.uuid4().hex, reason=reason, connect_session=session),
                                  chunk)

        assert verdicts("reject", 7, other, "bad") == {"match": False}
        rep = verdicts("reject", 7, mine, "bad")
        assert rep["match"] and rep["records"] == 1
        assert t.batches[1].verdicts.records() == [(topic, 0, 7, REJECT)] and not t.batches[0].verdicts
        with pytest.raises(VerdictError, match="not from batch"):  # batch 0's offset, in batch 1's session
            verdicts("release", 2, mine)
    finally:
        t.agents.clear()
        t.shutdown()


def test_a_server_that_refuses_the_listener_is_named(monkeypatch):
    """Without the server-side listener, acknowledgements wait for the next trigger: the user is told
    so, and what to do."""
    from spark_share import connect
    from spark_share.user import listener

    monkeypatch.setattr(connect, "is_connect", lambda spark: True)
    monkeypatch.setattr(connect, "install_server_listener", lambda spark, listener: False)
    with pytest.warns(UserWarning, match="refused a server-side query listener.*well below"):
        listener.install_listener(object())
