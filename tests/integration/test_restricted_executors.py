"""readMode=driver where the executors are sandboxed, emulated on the namespace cluster (tests/harness/spark_hosts.py):
what serverless compute, standard access mode and Kubernetes forbid user code on executors.

- (a) The executors reach no port of the driver host but Spark's own: in the driver's namespace, iptables drops
  every new connection from the network except to the master, ``spark.driver.port`` and
  ``spark.driver.blockManager.port`` (checked: a worker host cannot reach the tracker's port).
- (b) Nothing a task starts outlives it: a watcher ends, as soon as it appears, every process on the worker hosts
  that is not Spark's: one a Python worker started (below pyspark's daemon, not a worker itself), or one
  that left its parent (a detached process) other than the harness's relays and probes. A container torn
  down at the earliest.
- (c) A /tmp of its own on every host and a read-only root file system for the Spark workers and their
  executors (as the cluster always has: only /tmp and the shared directory, a volume, are writable there),
  in which nothing of spark-share appears (checked: the root mount of every JVM on a worker host is
  read-only).
- (d) Dynamic allocation: executors removed after a second idle (their shuffle files kept 2 s at most) and
  added again as batches come. In readMode=executors too (no sandbox: that mode needs what it forbids):
  every record read, and the agent of a removed executor leaves once the batch it holds is acknowledged.

Under them, a drain with a task that fails once and is retried on another host, and a foreachBatch that
raises after its write (the query restarted from its checkpoint): every record read, none lost, the watcher
never had anything to end, no file of ours on the worker hosts. readMode=executors under (a) to (c) fails
within 30 s naming readMode=driver. The user's process in another mount namespace than the driver: a Spark
Connect client, in test_connect.py.

Needs root, socat and iptables (./dev test installs them when it runs as root); without them the test skips,
naming what is missing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter

import pytest

from harness import cluster_runs
from harness.spark_hosts import MASTER_PORT
from harness.support import Workload, check_no_loss, gid, ids_of, wait_until

pytestmark = pytest.mark.slow

DRIVER_PORT, BLOCK_MANAGER_PORT, TRACKER_PORT = 7079, 7080, 7081
PROBE = "# sandbox probe"
PYSPARK = (b"pyspark.daemon", b"pyspark.worker")
HARNESS = (b"java", b"socat", b"unshare", b"spark-class", PROBE.encode())  # what the harness starts on a host


class Sandbox:
    """(a) and (b) on ``cluster`` while in the ``with``; ``ended`` lists what the watcher had to end."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.ended: list[str] = []
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="sandbox-watcher", daemon=True)

    def __enter__(self) -> Sandbox:
        self._iptables("-A", "INPUT", "-i", "eth0", "-p", "tcp", "-m", "conntrack", "--ctstate", "NEW", "-m", "multiport",
                       "!", "--dports", f"{MASTER_PORT},{DRIVER_PORT},{BLOCK_MANAGER_PORT}", "-j", "DROP")
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._watcher.join(10)
        self._iptables("-F", "INPUT")  # the cluster serves the run's other tests

    def _iptables(self, *args: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.cluster.ns("driver"), "iptables", *args], check=True)

    def _watch(self) -> None:
        workers = [h for h in self.cluster.hosts if h != "driver"]
        while not self._stop.wait(0.1):
            for host in workers:
                for pid in self.cluster.pids(host):
                    cmd = _cmdline(pid)
                    if cmd and not _sparks_own(pid, cmd):
                        try:
                            os.kill(pid, 9)
                        except ProcessLookupError:
                            continue
                        shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:200]
                        self.ended.append(f"{host}: {shown}")

    def reaches_tracker_port(self, host: str) -> bool:
        probe = (f"{PROBE}\nimport socket\ntry:\n socket.create_connection(({self.cluster.hosts['driver']!r}, {TRACKER_PORT}), 3)"
                 "\nexcept ConnectionRefusedError:\n print('refused')\nexcept OSError:\n print('no route')\nelse:\n print('open')")
        out = subprocess.run(["ip", "netns", "exec", self.cluster.ns(host), sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out != "no route"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _sparks_own(pid: int, cmd: bytes) -> bool:
    """Started by Spark (a JVM's helper: ``rm``, ``chmod``), pyspark's daemon or a worker it forked, or the
    harness; not something a Python worker started, nor a process that detached from its parent."""
    if any(p in cmd for p in PYSPARK) or any(h in cmd for h in HARNESS) or cmd.startswith(b"sh\0-c\0"):
        return True
    ancestor = _parent(pid)
    while ancestor > 1:
        up = _cmdline(ancestor)
        if any(p in up for p in PYSPARK):
            return False  # a Python worker's child
        if b"java" in up:
            return True
        ancestor = _parent(ancestor)
    return False  # detached (re-parented to init)


def root_mounts(cluster, host: str) -> dict[int, str]:
    """The options of the root mount as each of Spark's JVMs on ``host`` sees it (its mount namespace's)."""
    found = {}
    for pid in cluster.pids(host):
        if not _cmdline(pid).split(b"\0")[0].endswith(b"java"):
            continue
        try:
            with open(f"/proc/{pid}/mountinfo") as f:
                for line in f:
                    fields = line.split()
                    if fields[4] == "/":
                        found[pid] = fields[5]
        except OSError:
            continue
    return found


def ours_on(cluster, host: str) -> set[str]:
    """Files of spark-share under ``host``'s /tmp (agents' files of earlier tests included)."""
    return set(cluster_runs.spark_share_files(cluster, host))


# (d): executors removed once idle for a second and added again as batches come
DYNAMIC_ALLOCATION = ("--conf", "spark.dynamicAllocation.enabled=true",
                      "--conf", "spark.dynamicAllocation.shuffleTracking.enabled=true",
                      # A batch's count() leaves shuffle files, which keep their executor until the driver's
                      # garbage collector frees the shuffle (whenever that runs) unless this says otherwise:
                      # once in a run here, no executor went within 60 s.
                      "--conf", "spark.dynamicAllocation.shuffleTracking.timeout=2s",
                      "--conf", "spark.dynamicAllocation.executorIdleTimeout=1s",
                      "--conf", "spark.dynamicAllocation.minExecutors=0",
                      "--conf", "spark.dynamicAllocation.initialExecutors=1",
                      "--await-executor-removal-after", "3")
# The batch that waits for a removal (at most 60 s) holds its records meanwhile: a lock as long as that wait,
# Kafka's longest by default (group.share.max.record.lock.duration.ms), so no lock expires in it.
AWAIT_LOCK_MS = 60_000


def removals(res: dict) -> tuple[dict, int]:
    """The batch during which an executor was removed, and how many removals the samples saw."""
    idle = [b for b in res["batches"] if "executorsBefore" in b]
    assert idle and idle[0]["executorsAfter"] < idle[0]["executorsBefore"], f"no executor was removed: {idle}"
    later = [b for b in res["batches"] if b["t"] > idle[0]["t"] and b["count"]]
    assert later, "no batch read records after the executors were removed"  # Spark added executors for them
    executors = [s["executors"] for s in res["samples"] if s.get("executors", -1) >= 0]
    return idle[0], sum(1 for a, b in zip(executors, executors[1:]) if b < a)


def elastic_backlog(cluster, kafka, name: str) -> tuple[Workload, list[int], str, str]:
    """1,500 records on 3 partitions for a run under dynamic allocation: the workload, its ids, the group and
    the run's shared directory."""
    w = Workload(kafka, name, partitions=3)
    ids = w.produce(1500)
    kafka.set_record_lock_duration(AWAIT_LOCK_MS)
    return w, ids, kafka.group(gid()), os.path.join(cluster.shared, f"{name}-{gid()}")


def test_driver_mode_reads_everything_on_executors_that_may_run_nothing_of_ours(namespace_cluster, kafka):
    cluster = namespace_cluster
    w, ids, group, shared = elastic_backlog(cluster, kafka, "sandboxed")
    workers = [h for h in cluster.hosts if h != "driver"]
    before = {h: ours_on(cluster, h) for h in workers}
    cluster.forward(kafka.bootstrap_servers)  # its probes run on the worker hosts: before the watcher starts
    with Sandbox(cluster) as sandbox:
        app = cluster_runs.run_app(cluster, kafka, "drain", w.topic, group, shared, "--partitions", "3",
                                   "--max-per-trigger", "300", "--option", "readMode=driver",
                                   "--option", f"trackerPort={TRACKER_PORT}",
                                   "--fail-first-attempt", "1", "--crash-after-write", "2",
                                   "--conf", f"spark.driver.port={DRIVER_PORT}",
                                   "--conf", f"spark.driver.blockManager.port={BLOCK_MANAGER_PORT}",
                                   "--conf", "spark.excludeOnFailure.enabled=true",
                                   "--conf", "spark.excludeOnFailure.task.maxTaskAttemptsPerNode=1",
                                   *DYNAMIC_ALLOCATION)
        res = cluster_runs.result(app, shared, 600)
        assert not sandbox.reaches_tracker_port("w1"), "the sandbox let a worker host reach the tracker's port"
        roots = {h: root_mounts(cluster, h) for h in workers}
    # Every worker host runs a Spark worker, whose JVM and its executors' see a read-only root.
    assert all(roots.values()) and all(o.split(",")[0] == "ro" for r in roots.values() for o in r.values()), (
        f"a worker host ran no Spark JVM, or its root file system was writable: {roots}")
    assert res["error"] is None, res["error"]
    assert sandbox.ended == [], f"readMode=driver started processes on the executors: {sandbox.ended}"
    assert {h: ours_on(cluster, h) - before[h] for h in workers} == {h: set() for h in workers}
    rows = cluster_runs.written(shared)
    crashed = [r for r in rows if r["run"] == 0 and r["batch"] == 2]
    assert crashed, "the crash after the write never happened"
    again = {i for i, r in zip(ids_of(rows), rows) if r["run"] == 1 and r["deliveryCount"] >= 2}
    assert set(ids_of(crashed)) <= again, "records of the batch that failed after its write did not come back"
    report = check_no_loss(ids, ids_of(rows), duplicates_reason="batch 2, written before its foreachBatch raised")
    if kafka.external:  # the embedded broker hands records out again when a member joins
        twice = Counter(ids_of(rows))
        where = Counter((r["run"], r["batch"]) for i, r in zip(ids_of(rows), rows) if twice[i] > 1)
        expired = max((s.get("expired") or 0 for s in res["samples"]), default=0)
        assert report.duplicates == len(crashed), (report, f"rows written twice by (run, batch): {dict(where)}; "
                                                           f"locks expired: {expired}")
        # Spark ran batch 2 again with the same records: a sink that skips a batch id it has gets each once.
        once = check_no_loss(ids, ids_of(cluster_runs.idempotent_view(rows)))
        assert once.duplicates == 0, once
    retried = [n for n in os.listdir(os.path.join(shared, "attempts")) if n.endswith("-1")]
    assert retried, "Spark retried no task"
    _, went = removals(res)
    # Both actions of every batch (a count, then the write, no persist) saw the same rows, the retried one too.
    cluster_runs.counts_match_writes(res, [r for r in rows if not (r["run"] == 0 and r["batch"] == 2)])
    print(f"readMode=driver, sandboxed executors: {len(ids)} records, {report.duplicates} written twice "
          f"(batch 2's {len(crashed)}), {len(retried)} task(s) retried on another host; {went} executor removals")


def test_executors_mode_under_dynamic_allocation_lets_removed_executors_agents_go(namespace_cluster, kafka):
    """(d) in readMode=executors: executors removed while idle and added again. Every record is read; the agent
    of a removed executor (a process that outlives tasks, so nothing of Spark's ends it) leaves once what it
    holds is acknowledged, instead of holding share-group members until the query ends; none is left after."""
    cluster = namespace_cluster
    w, ids, group, shared = elastic_backlog(cluster, kafka, "elastic")
    cluster.forward(kafka.bootstrap_servers)
    app = cluster_runs.run_app(cluster, kafka, "drain", w.topic, group, shared, "--partitions", "3",
                               "--max-per-trigger", "300", "--option", "readMode=executors", *DYNAMIC_ALLOCATION)
    res = cluster_runs.result(app, shared, 600)
    assert res["error"] is None, res["error"]
    rows = cluster_runs.written(shared)
    report = check_no_loss(ids, ids_of(rows), duplicates_reason="the embedded broker hands records out again "
                           "when a member joins")
    if kafka.external:
        assert report.duplicates == 0, report
    idle, went = removals(res)
    agents = [(s["t"], s["agents"]) for s in res["samples"] if "agents" in s]
    peak = max(n for t, n in agents if t <= idle["t"])
    after = [n for t, n in agents if t > idle["t"]]
    assert after and min(after) < peak, f"no agent left after its executor was removed: {agents}"
    cluster_runs.counts_match_writes(res, rows)
    wait_until(lambda: not any(cluster_runs.agents_on(cluster, h) for h in cluster.hosts), timeout=60,
               message="agents left running after the query")
    print(f"readMode=executors, dynamic allocation: {len(ids)} records, {report.duplicates} written twice; "
          f"{went} executor removals; agents over the run {[n for _, n in agents]}")


def test_executors_mode_in_the_sandbox_fails_promptly_naming_driver_mode(namespace_cluster, kafka):
    """readMode=executors needs what the sandbox forbids: the query fails (never hangs, never reads a record
    it could not acknowledge) with an error that says why and names readMode=driver."""
    cluster = namespace_cluster
    w = Workload(kafka, "forbidden", partitions=3)
    w.produce(300)
    group = kafka.group(gid())
    shared = os.path.join(cluster.shared, f"forbidden-{gid()}")
    cluster.forward(kafka.bootstrap_servers)
    with Sandbox(cluster) as sandbox:
        app = cluster_runs.run_app(cluster, kafka, "drain", w.topic, group, shared, "--partitions", "3",
                                   "--option", "readMode=executors", "--option", f"trackerPort={TRACKER_PORT}",
                                   "--conf", f"spark.driver.port={DRIVER_PORT}",
                                   "--conf", f"spark.driver.blockManager.port={BLOCK_MANAGER_PORT}")
        res = cluster_runs.result(app, shared, 300)
    assert res["error"] and "readMode=driver" in res["error"], res["error"]
    assert any("spark_share.consumers.agent" in e for e in sandbox.ended), sandbox.ended
    assert not cluster_runs.written(shared), "rows reached the sink from a query that cannot acknowledge them"
    # From the query's start (the driver program marks it) to its result.
    failed_after = os.path.getmtime(os.path.join(shared, "result.json")) - os.path.getmtime(os.path.join(shared, "running"))
    print(f"readMode=executors in the sandbox: failed {failed_after:.1f} s after the query started: {res['error'][:400]}")
    assert failed_after < 30, f"the query took {failed_after:.0f} s to fail"
