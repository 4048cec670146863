"""kafka-share on a Spark standalone cluster of separate hosts (network namespaces: tests/cluster.py):
the driver on its own host, three worker hosts with one core each, the embedded broker reached
from every host.

The driver program (cluster_app.py) runs on the driver host and leaves its results in the
cluster's shared directory; these tests judge them. Needs root and socat (`.ci/run` installs
socat); without them the tests fail saying why.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from cluster import NamespaceCluster
from support import Workload, check_no_loss, drain_share_group, gid, wait_until

pytestmark = pytest.mark.slow

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_app.py")
WORKERS = 3


@pytest.fixture(scope="module")
def cluster():
    c = NamespaceCluster(workers=WORKERS, cores=1, memory="1g")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def _run_app(cluster, kafka, mode: str, topic: str, group: str, shared: str, *extra: str) -> subprocess.Popen:
    cluster.forward(kafka.bootstrap_servers)
    os.makedirs(shared, exist_ok=True)
    argv = [sys.executable, APP, mode, "--master", cluster.master_url, "--driver-host", cluster.hosts["driver"],
            "--bootstrap", kafka.bootstrap_servers, "--topic", topic, "--group", group, "--shared", shared,
            "--cores-max", str(WORKERS), *extra]
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return cluster.spawn("driver", argv, env=env, log_name=f"app-{os.path.basename(shared)}.log")


def _result(app: subprocess.Popen, shared: str, timeout: float) -> dict:
    try:
        app.wait(timeout)
    except subprocess.TimeoutExpired:
        app.kill()
        raise AssertionError(f"the driver program did not finish in {timeout:.0f} s: {_tail(app.log_path)}") from None
    path = os.path.join(shared, "result.json")
    assert os.path.exists(path), f"the driver program left no result (exit {app.returncode}): {_tail(app.log_path)}"
    return json.load(open(path))


def _tail(path: str) -> str:
    return open(path, errors="replace").read()[-4000:]


def _written(shared: str) -> list[dict]:
    """The rows of committed files (a job's files appear under _temporary first, then are renamed)."""
    rows = []
    for f in glob.glob(os.path.join(shared, "out", "*.parquet")):
        try:
            rows += pq.read_table(f, columns=["value", "batch", "deliveryCount"]).to_pylist()
        except FileNotFoundError:  # an aborted attempt's file, removed meanwhile
            continue
    return rows


def _ids(rows) -> list[int]:
    return [json.loads(bytes(r["value"]))["id"] for r in rows]


def test_drain_on_three_hosts(cluster, kafka, tmp_path):
    """AvailableNow drains and ends; nothing lost or doubled; the two actions of every batch (no
    persist) saw the same rows wherever they ran; at most one share consumer per task slot that reads."""
    w = Workload(kafka, "orders", partitions=4)
    ids = w.produce(3000)
    group = gid()
    shared = os.path.join(cluster.shared, "drain")
    app = _run_app(cluster, kafka, "drain", "orders", group, shared, "--partitions", "8",
                   "--max-per-trigger", "1000")
    res = _result(app, shared, 600)
    assert res["error"] is None, res["error"]
    rows = _written(shared)
    hosts = [s["hosts"] for s in res["samples"] if s.get("hosts")]
    assert hosts, "status() never showed an agent"
    members = max(sum(h["members"] for h in s.values()) for s in hosts)
    print("members per host at the end:", hosts[-1], "; most members at once:", members)
    # The embedded broker ends every member's share session when one joins (real Kafka does not),
    # so the pools growing on each host during the first batches may deliver records again.
    report = check_no_loss(ids, _ids(rows), duplicates_reason="members joining while others held records "
                           "(embedded broker)")
    written: dict[int, int] = {}
    for r in rows:
        written[r["batch"]] = written.get(r["batch"], 0) + 1
    counts = {b["batch"]: b["count"] for b in res["batches"] if b["count"]}
    assert counts == written, f"the batch's count and its write saw different rows: {counts} != {written}"
    assert len({h for s in hosts for h in s}) == 3, f"the read did not run on every host: {hosts[-1]}"
    # One session serves one slot per batch: a host has about as many members as slots it reads.
    assert members <= 8 + WORKERS, f"{members} group members for numPartitions=8 on {WORKERS} hosts"
    print(f"drained {len(ids)} records in {len(counts)} batches; {report.duplicates} delivered twice")
    assert drain_share_group(kafka.bootstrap_servers, group, ["orders"], timeout=3) == []


def test_a_host_lost_mid_stream(cluster, kafka, tmp_path):
    """One worker host dies (its worker, executor, Python workers and agent, SIGKILL) in the middle of
    a stream: the query goes on on the other hosts, nothing is lost, the records the host held
    come back (counted as duplicates)."""
    kafka.set_record_lock_duration(10_000)
    w = Workload(kafka, "jobs", partitions=4)
    ids = w.produce(4000)
    group = gid()
    shared = os.path.join(cluster.shared, "loss")
    app = _run_app(cluster, kafka, "stream", "jobs", group, shared, "--partitions", "3",
                   "--max-per-trigger", "300")
    seen_path = os.path.join(shared, "batches.jsonl")

    def batches():
        try:
            return [json.loads(line) for line in open(seen_path) if line.strip()]
        except FileNotFoundError:
            return []

    wait_until(lambda: len(batches()) >= 3 or app.poll() is not None, timeout=300,
               message="the stream did not run 3 batches")
    assert app.poll() is None, f"the driver program ended early: {_tail(app.log_path)}"
    victim = "w2"
    killed = cluster.kill_host(victim)
    assert killed, "nothing ran on the host"
    after = len(batches())
    try:
        wait_until(lambda: len(set(_ids(_written(shared)))) == len(ids) or app.poll() is not None, timeout=300,
                   interval=2, message="the stream did not deliver every record after a host was lost")
    except AssertionError as e:
        raise AssertionError(f"{e}: {len(set(_ids(_written(shared))))} of {len(ids)} delivered; batches since the "
                             f"loss: {batches()[after:][-8:]}; driver log: {_tail(app.log_path)[-6000:]}") from None
    assert len(batches()) > after
    open(os.path.join(shared, "stop"), "w").close()
    res = _result(app, shared, 180)
    assert res["error"] is None, res["error"]
    report = check_no_loss(ids, _ids(_written(shared)), duplicates_reason=f"host {victim} was lost mid-batch")
    print(f"host {victim} lost: {len(killed)} processes killed; {report.duplicates} duplicates")
    assert drain_share_group(kafka.bootstrap_servers, group, ["jobs"], timeout=3) == []
