"""Running the driver program of the cluster tests (tests/integration/cluster_app.py) on a NamespaceCluster,
and reading what it left in the cluster's shared directory: its result, the rows its sink wrote, the
batches it saw, the logs of spark-share's processes on each host.

A driver program is a Spark application on the driver host: it reads a topic with kafka-share, writes
each batch twice (a count, then Parquet) and samples ``status()``; ``stream`` mode runs until
``<shared>/stop`` exists, ``drain`` mode until the drain ends.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq

from harness.spark_hosts import NamespaceCluster

APP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration", "cluster_app.py")
WORKERS = 3


def start_cluster() -> NamespaceCluster:
    return NamespaceCluster(workers=WORKERS, cores=1, memory="1g").start()


def run_app(cluster: NamespaceCluster, kafka, mode: str, topic: str, group: str, shared: str, *extra: str,
            host: str = "driver") -> subprocess.Popen:
    """The driver program on ``host`` (the driver host unless the test moves it), reading ``topic``."""
    cluster.forward(kafka.bootstrap_servers)
    os.makedirs(shared, exist_ok=True)
    argv = [sys.executable, APP, mode, "--master", cluster.master_url, "--driver-host", cluster.hosts[host],
            "--bootstrap", kafka.bootstrap_servers, "--topic", topic, "--group", group, "--shared", shared,
            "--cores-max", str(WORKERS), *extra]
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYSPARK_PYTHON": sys.executable}
    return cluster.spawn(host, argv, env=env, log_name=f"app-{os.path.basename(shared)}-{host}.log")


def result(app: subprocess.Popen, shared: str, timeout: float) -> dict:
    try:
        app.wait(timeout)
    except subprocess.TimeoutExpired:
        app.kill()
        raise AssertionError(f"the driver program did not finish in {timeout:.0f} s: {tail(app.log_path)}") from None
    path = os.path.join(shared, "result.json")
    assert os.path.exists(path), f"the driver program left no result (exit {app.returncode}): {tail(app.log_path)}"
    with open(path) as f:
        return json.load(f)


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return "(no log)"


def written(shared: str) -> list[dict]:
    """The rows of committed files (a job's files appear under _temporary first, then are renamed)."""
    rows = []
    for f in glob.glob(os.path.join(shared, "out", "*.parquet")):
        try:
            rows += pq.read_table(f, columns=["value", "batch", "task", "deliveryCount", "run"]).to_pylist()
        except FileNotFoundError:  # an aborted attempt's file, removed meanwhile
            continue
    return rows


def idempotent_view(rows: list[dict]) -> list[dict]:
    """What a sink that writes each batch id once (Delta's txnVersion, a foreachBatch that skips a batch id it
    has) would hold of these rows: each batch id's rows from the first run that wrote it."""
    first = {}
    for r in rows:
        first[r["batch"]] = min(first.get(r["batch"], r["run"]), r["run"])
    return [r for r in rows if r["run"] == first[r["batch"]]]


def batches(shared: str) -> list[dict]:
    """The batches the driver program has seen so far (it appends one line per batch)."""
    try:
        with open(os.path.join(shared, "batches.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def counts_match_writes(res: dict, rows: list[dict]) -> dict[int, int]:
    """Every batch's first action (its count) and second (its write, no persist: the batch is read
    again, maybe on another host) saw the same rows. Returns the rows per batch."""
    per_batch: dict[int, int] = {}
    for r in rows:
        per_batch[r["batch"]] = per_batch.get(r["batch"], 0) + 1
    counts = {b["batch"]: b["count"] for b in res["batches"] if b["count"]}
    assert counts == per_batch, f"the batch's count and its write saw different rows: {counts} != {per_batch}"
    return counts


def spark_share_files(cluster: NamespaceCluster, host: str) -> list[str]:
    """spark-share's files on ``host``: the runtime directory (a driver's) and the agents' files in the
    executors' Spark local dirs (Spark removes those when the application ends)."""
    tmp = cluster.host_tmp(host)
    return sorted(glob.glob(os.path.join(tmp, "spark-share-*", "*"))
                  + glob.glob(os.path.join(tmp, "**", "blockmgr-*", "agent-*"), recursive=True))


def is_log(path: str) -> bool:
    name = os.path.basename(path)
    return name.endswith(".log") or ".log." in name


def host_logs(cluster: NamespaceCluster, host: str, prefix: str) -> str:
    """spark-share's logs on ``host`` whose names start with ``prefix`` (``tracker-``, ``agent-``)."""
    out = []
    for path in spark_share_files(cluster, host):
        if is_log(path) and os.path.basename(path).startswith(prefix):
            out.append(tail(path, 1 << 22))
    return "\n".join(out)


def tasks_started(cluster: NamespaceCluster, host: str) -> list[float]:
    """When a Spark task's Python code started on ``host`` (wall clock, whole seconds: the resolution of the
    executors' log lines ``Starting Python task execution``), sorted. Before that, over Spark's own
    connections to the driver, the task reached the executor (``Got assigned task``) and the executor
    fetched the task's broadcast from the driver: after a cut each can wait for the kernel's next
    retransmission (a CI run: tasks assigned 2 s after a driver cut, their broadcasts read 4.6-9.4 s later)."""
    import datetime as dt

    out = []
    for path in glob.glob(os.path.join(cluster.host_tmp(host), "spark-work", "app-*", "*", "stderr")):
        with open(path, errors="replace") as f:
            for line in f:
                if "Starting Python task execution" in line:
                    try:
                        out.append(dt.datetime.strptime(line[:17], "%y/%m/%d %H:%M:%S").timestamp())
                    except ValueError:
                        continue
    return sorted(out)


def agents_on(cluster: NamespaceCluster, host: str) -> list[int]:
    """The pids of spark-share agents running on ``host``."""
    out = []
    for pid in cluster.pids(host):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spark_share.consumers.agent" in f.read():
                    out.append(pid)
        except OSError:
            continue
    return out
