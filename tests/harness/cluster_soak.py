"""Soak on a cluster of hosts: a continuous kafka-share query on the namespace cluster (a driver host and
three worker hosts: tests/harness/spark_hosts.py) for hours, under random faults of every kind the
network and lost-driver tests prove one at a time; then the no-loss check and the resource verdict.

    .venv/bin/python tests/harness/cluster_soak.py --minutes 120 --seed 3 --out soak-out   # the soak (as root)
    .venv/bin/python tests/harness/cluster_soak.py --minutes 4.3 --mean-gap 8 --seed 1 --out soak-ci   # CI's few minutes

This process is Kafka and the operator: it runs the embedded broker (three brokers), produces at a steady
rate the whole time, draws the faults from ``--seed`` and injects them one after another, restarts the
driver program when it ends or is lost (as a scheduler retries a job), samples the resources of every
process on every host, and judges the run. The driver program is tests/integration/cluster_app.py in
``stream`` mode (foreachBatch: a count, then a Parquet write).

The faults (each lasting twice the record lock where it has a length): a worker host's link cut; the
driver cut from the workers; 100 ms delay and 5 % loss on a worker's link; a broker down; a worker host
lost (everything on it killed) and back; an agent killed; the driver host lost (its processes frozen)
and the job started again from its checkpoint on another host.

Exit 0 when: every record produced was written (0 lost); every record written twice was written again
after a fault (or after a start of the driver program: on the embedded broker a member joining ends
every member's share session); no agent is left on any host and no member in the group once the query
stopped; and, with ``--judge-growth``, no resource series keeps growing after warm-up. report.json,
resources.json and resources.png land in --out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

LOCK_S = 12  # the group's record lock; faults with a length last twice that
SESSION_S = 6  # the group's session timeout
PARTITIONS = 6
RATE = (50, 0.5)  # records every so many seconds
FAULTS = ("link_cut", "driver_cut", "impaired", "broker_down", "host_lost", "agent_killed", "driver_lost")
DRIVER_HOSTS = ("driver", "w3")  # a lost driver's job starts again on the other
EFFECT_S = LOCK_S + 20.0  # how long after a fault ends records it touched may still come back
# No fault starts in the run's last TAIL_S: the last one (2 x LOCK_S at most) ends, and its effects settle, before
# the run stops producing and checks that every record was written.
TAIL_S = EFFECT_S + 15.0
ACQUIRED_BEFORE_S = 15.0  # a batch's records were acquired at most this long before it finished


@dataclass
class Fault:
    gap: float  # seconds after the fault before it ended (the first: after the query's start)
    kind: str
    host: str = ""
    started: float | None = None  # wall clock
    ended: float | None = None
    outcome: str = ""


def schedule(seed: int, mean_gap: float, n: int = 1000) -> list[Fault]:
    """The run's faults, from ``seed`` alone (the run injects them until its end nears); kinds in shuffled
    rounds (as many faults as kinds: each kind once), gaps exponential from the end of the fault before."""
    rnd = random.Random(seed)
    out: list[Fault] = []
    kinds: list[str] = []
    for i in range(n):
        if not kinds:
            kinds = list(FAULTS)
            rnd.shuffle(kinds)
        gap = 45.0 if i == 0 else rnd.expovariate(1 / mean_gap)  # the first after the stream has started
        out.append(Fault(round(gap, 1), kinds.pop(), rnd.choice(["w1", "w2", "w3"])))
    return out


class Driver:
    """The driver program, started again whenever it ends or is lost: ``runs`` counts its starts."""

    def __init__(self, cluster, kafka, topic: str, group: str, shared: str):
        from harness import cluster_runs

        self._runs_mod = cluster_runs
        self.cluster, self.kafka, self.topic, self.group, self.shared = cluster, kafka, topic, group, shared
        self.host = "driver"
        self.runs = 0
        self.starts: list[float] = []  # wall clock of each start
        self.ended: list[str] = []  # why each run before the last ended
        self.app: subprocess.Popen | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        self.app = self._runs_mod.run_app(self.cluster, self.kafka, "stream", self.topic, self.group, self.shared,
                                          "--partitions", "3", "--run", str(self.runs), host=self.host)
        self.starts.append(time.time())
        self.runs += 1

    def restart_if_ended(self) -> str | None:
        with self.lock:
            if self.app is None or self.app.poll() is None:
                return None
            why = f"run {self.runs - 1} ended (exit {self.app.returncode}): {self._error()}"
            self.ended.append(why)
            self.start()
            return why

    def _error(self) -> str:
        try:
            with open(os.path.join(self.shared, "result.json")) as f:
                return (json.load(f).get("error") or "no error")[:300]
        except (OSError, ValueError):
            return "no result"

    def lose(self, agents_gone) -> str:
        """The driver host lost mid-stream (its processes frozen: nothing closes a connection); once the
        run's agents are gone (bounded), the frozen run is killed and the job starts on the other host."""
        with self.lock:
            app = self.app
            assert app is not None
            os.killpg(app.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            gone = agents_gone(2 * LOCK_S)
            took = time.monotonic() - frozen
            os.killpg(app.pid, signal.SIGKILL)
            app.wait(30)
            self.ended.append(f"run {self.runs - 1} lost with its host {self.host}")
            self.host = DRIVER_HOSTS[(DRIVER_HOSTS.index(self.host) + 1) % 2] if self.host in DRIVER_HOSTS else "driver"
            self.start()
        return (f"driver host frozen; its agents {'gone' if gone else 'NOT gone'} after {took:.1f} s; "
                f"the job started again on {self.host}")

    def stop(self, timeout: float) -> dict:
        open(os.path.join(self.shared, "stop"), "w").close()
        with self.lock:
            assert self.app is not None
            return self._runs_mod.result(self.app, self.shared, timeout)


class Operator:
    """Injects the faults at their times, on its own thread, one at a time."""

    def __init__(self, cluster, kafka, driver: Driver, faults: list[Fault], t0: float, until_s: float):
        from harness.netfaults import NetFaults

        self.cluster, self.kafka, self.driver, self.faults, self.t0 = cluster, kafka, driver, faults, t0
        self.until_s = until_s  # no fault starts after this many seconds (the run's end needs a quiet tail)
        self.injected: list[Fault] = []
        self.net = NetFaults(cluster)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="operator", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> Operator:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)
        self.net.clear()

    def _run(self) -> None:
        try:
            for f in self.faults:
                due = time.monotonic() + f.gap
                while not self._stop.wait(1.0):  # the schedule's clock, and the driver program's watchdog
                    self.driver.restart_if_ended()
                    if time.monotonic() >= due:
                        break
                if self._stop.is_set() or time.monotonic() - self.t0 > self.until_s:
                    break
                self.injected.append(f)
                f.started = time.time()
                f.outcome = getattr(self, "_" + f.kind)(f)
                f.ended = f.ended or time.time()
                print(f"[{time.monotonic() - self.t0:7.1f} s] {f.kind}: {f.outcome}", flush=True)
            while not self._stop.wait(1.0):
                self.driver.restart_if_ended()
        except BaseException as e:  # reported at the end
            self.error = e

    def _outage(self, seconds: float) -> None:
        self._stop.wait(seconds)  # the fault's length: what the run is about, not a synchronisation

    def _link_cut(self, f: Fault) -> str:
        self.net.cut(f.host)
        try:
            self._outage(2 * LOCK_S)
        finally:
            self.net.restore(f.host)
        return f"{f.host}'s link down {2 * LOCK_S} s"

    def _driver_cut(self, f: Fault) -> str:
        host = self.driver.host
        others = [h for h in self.cluster.hosts if h != host]
        f.host = host
        self.net.isolate(host, others)
        try:
            self._outage(2 * LOCK_S)
        finally:
            self.net.clear(host)
        return f"the driver host {host} cut from {others} for {2 * LOCK_S} s"

    def _impaired(self, f: Fault) -> str:
        self.net.impair(f.host, delay_s=0.1, loss=0.05)
        try:
            self._outage(2 * LOCK_S)
        finally:
            self.net.clear(f.host)
        return f"{f.host}: 100 ms delay, 5 % loss for {2 * LOCK_S} s"

    def _broker_down(self, f: Fault) -> str:
        broker = int(f.host[1:])  # w1..w3: one of the three brokers
        self.kafka.broker_down(broker)
        try:
            self._outage(LOCK_S)
        finally:
            self.kafka.broker_up(broker)
        return f"broker {broker} down {LOCK_S} s"

    def _host_lost(self, f: Fault) -> str:
        if f.host == self.driver.host:
            f.host = next(h for h in ("w1", "w2", "w3") if h != self.driver.host)
        killed = self.cluster.kill_host(f.host)
        self._outage(LOCK_S)
        self.cluster.revive(f.host)
        return f"{f.host} lost ({len(killed)} processes killed), back after {LOCK_S} s"

    def _agent_killed(self, f: Fault) -> str:
        from harness import cluster_runs

        pids = cluster_runs.agents_on(self.cluster, f.host)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return f"{len(pids)} agent(s) on {f.host} killed" if pids else f"no agent on {f.host}"

    def _driver_lost(self, f: Fault) -> str:
        from harness import cluster_runs

        before = {h: set(cluster_runs.agents_on(self.cluster, h)) for h in self.cluster.hosts}
        f.host = self.driver.host

        def agents_gone(timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if not any(set(cluster_runs.agents_on(self.cluster, h)) & before[h] for h in self.cluster.hosts):
                    return True
                self._stop.wait(0.5)  # a bounded poll of the hosts' processes
            return False
        return self.driver.lose(agents_gone)


class ClusterSampler:
    """Every process on every host (resources.measure: per kind, RSS, files, threads, sockets), the runtime
    directories' files and bytes (logs apart) and the checkpoint, every ``interval`` s."""

    def __init__(self, cluster, checkpoint: str, interval: float):
        self.cluster, self.checkpoint, self.interval = cluster, checkpoint, interval
        self.samples: list[dict] = []
        self._t0 = time.monotonic()
        self.wall0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cluster-sampler", daemon=True)

    def start(self) -> ClusterSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(60)
        return self.samples

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append(self.sample())

    def sample(self) -> dict:
        import psutil

        from harness import cluster_runs, resources

        processes = {}
        for host in self.cluster.hosts:
            for pid in self.cluster.pids(host):
                try:
                    p = psutil.Process(pid)
                    kind = "driver" if "cluster_app.py" in " ".join(p.cmdline()) else resources.process_kind(p, -1)
                except psutil.Error:
                    continue
                if kind:
                    processes[pid] = (kind, p)
        files = size = logs = 0
        for host in self.cluster.hosts:
            for path in cluster_runs.spark_share_files(self.cluster, host):
                try:
                    n = os.stat(path).st_size
                except OSError:
                    continue
                if cluster_runs.is_log(path):
                    logs += n
                else:
                    files, size = files + 1, size + n
        return {"t": round(time.monotonic() - self._t0, 2), "kinds": resources.measure(processes),
                "runtime_files": files, "runtime_bytes": size, "log_bytes": logs,
                "checkpoint_files": resources.files_under(self.checkpoint)[0]}


def explain(rows: list[dict], batches: list[dict], faults: list[Fault],
            starts: list[float]) -> tuple[Counter, int, Counter]:
    """Every record written more than once: the fault (or the driver program's start) its later write
    followed, by kind. Returns (kind -> records, records no fault explains, and those by the (run, batch)
    that wrote them again: where to look)."""
    from harness.support import ids_of

    done = {(b["run"], b["batch"]): b["t"] for b in batches}
    windows = [(f.started, (f.ended or f.started) + EFFECT_S, f.kind) for f in faults if f.started]
    windows += [(s, s + EFFECT_S + 30, "start") for s in starts]  # the joins of a start (embedded broker)
    writes: dict[int, list[tuple[float, tuple]]] = {}
    for i, r in zip(ids_of(rows), rows):
        writes.setdefault(i, []).append((done.get((r["run"], r["batch"]), 0.0), (r["run"], r["batch"])))
    why: Counter = Counter()
    where: Counter = Counter()
    unexplained = 0
    for ws in writes.values():
        ws.sort()
        for (first, _), (later, batch) in zip(ws, ws[1:]):
            kinds = sorted({k for s, e, k in windows if s <= later and e >= first - ACQUIRED_BEFORE_S})
            if kinds:
                why[" + ".join(kinds)] += 1
            else:
                unexplained += 1
                where[batch] += 1
    return why, unexplained, where


JOIN_LINES = ("joined the group", "started share session")  # an agent's log line when a member joins


def member_joins(cluster, hosts) -> list[float]:
    """When a member joined the group (wall clock), from the agents' logs on every host: on the embedded
    broker a join ends every member's share session, so the records they held come back."""
    import datetime as dt

    from harness.cluster_runs import host_logs

    out = []
    for host in hosts:
        for line in host_logs(cluster, host, "").splitlines():
            if any(j in line for j in JOIN_LINES):
                try:
                    out.append(dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp())
                except ValueError:
                    continue
    return sorted(out)


def keep_logs(cluster, hosts, out: str) -> None:
    """spark-share's logs of every host (trackers' and agents'), copied to ``out``/logs before the cluster's
    files go: what to read when a batch wrote duplicates no fault explains."""
    import shutil

    from harness import cluster_runs

    for host in hosts:
        dest = os.path.join(out, "logs", host)
        os.makedirs(dest, exist_ok=True)
        for path in cluster_runs.spark_share_files(cluster, host):
            if cluster_runs.is_log(path):
                try:
                    shutil.copy(path, dest)
                except OSError:  # removed meanwhile with its application's local dirs
                    pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=120)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mean-gap", type=float, default=60.0, help="mean seconds between the end of a fault and the next")
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--judge-growth", action="store_true", help="fail on a resource series that keeps growing")
    ap.add_argument("--warmup-minutes", type=float, default=10.0)
    args = ap.parse_args(argv)

    from harness import cluster_runs, resources
    from harness.kafka_cluster import EmbeddedCluster
    from harness.support import PacedProducer, ShareGroups, Workload, gid, ids_of

    os.makedirs(args.out, exist_ok=True)
    seconds = args.minutes * 60
    faults = schedule(args.seed, args.mean_gap)
    print(f"soak: {args.minutes} min, seed {args.seed}, a fault every {args.mean_gap:.0f} s on average after the "
          "one before ends", flush=True)
    cluster = cluster_runs.start_cluster()
    kafka = EmbeddedCluster(brokers=3, record_lock_duration_ms=LOCK_S * 1000, session_timeout_ms=SESSION_S * 1000)
    producer = operator = sampler = None
    try:
        w = Workload(kafka, "soak", partitions=PARTITIONS)
        group = kafka.group(gid())
        shared = os.path.join(cluster.shared, "soak")
        sampler = ClusterSampler(cluster, os.path.join(shared, "ck"), args.sample_every).start()
        producer = PacedProducer(w, *RATE).start()
        driver = Driver(cluster, kafka, w.topic, group, shared)
        driver.start()
        t0 = time.monotonic()
        operator = Operator(cluster, kafka, driver, faults, t0, until_s=seconds - TAIL_S).start()
        while time.monotonic() - t0 < seconds and operator.error is None:
            time.sleep(1.0)  # the run's length
        operator.stop()
        assert operator.error is None, f"the operator failed: {operator.error!r}"
        errors = producer.stop()
        assert errors == [], f"the producer failed: {errors}"
        ids = set(w.ids)
        deadline = time.monotonic() + 600
        while not ids <= set(ids_of(cluster_runs.written(shared))) and time.monotonic() < deadline:
            driver.restart_if_ended()
            time.sleep(2.0)  # a bounded wait for the stream to write the last records
        # Read while the application runs: Spark removes its executors' local dirs, the agents' logs with them
        # (copied again after the stop, for their last lines, where they are still there).
        joins = member_joins(cluster, cluster.hosts)
        keep_logs(cluster, cluster.hosts, args.out)
        res = driver.stop(300)
        samples = sampler.stop()
        rows = cluster_runs.written(shared)
        batches = cluster_runs.batches(shared)
        written = ids_of(rows)
        done_at = {(b["run"], b["batch"]): b["t"] for b in batches}
        faults = operator.injected
        why, unexplained, where = explain(rows, batches, faults, driver.starts)
        # not an explanation the verdict takes: how many of the unexplained were written again within
        # EFFECT_S after a member joined (what the embedded broker's session ends would cause)
        after_join = sum(n for (r, b), n in where.items()
                         if any(j <= done_at.get((r, b), 0.0) <= j + EFFECT_S for j in joins))
        agents_left = {h: cluster_runs.agents_on(cluster, h) for h in cluster.hosts}
        deadline = time.monotonic() + 60
        while any(agents_left.values()) and time.monotonic() < deadline:
            time.sleep(1.0)  # agents end once their tracker is gone: a bounded wait
            agents_left = {h: cluster_runs.agents_on(cluster, h) for h in cluster.hosts}
        keep_logs(cluster, cluster.hosts, args.out)
        # A member whose consumer ended without leaving (its agent killed, or cut off at the end) is the
        # broker's until the session timeout: one still there after it is one left behind.
        deadline = time.monotonic() + SESSION_S + 10
        members_left = ShareGroups(kafka).members(group)
        while members_left and time.monotonic() < deadline:
            time.sleep(0.5)  # a bounded wait for the broker's session timeout
            members_left = ShareGroups(kafka).members(group)
        try:
            verdicts = resources.growth_verdict(samples, min(args.warmup_minutes * 60, seconds / 3))
        except ValueError as e:  # too short a run to judge growth (CI's few minutes)
            print(f"growth not judged: {e}")
            verdicts = []
        summary = {
            "minutes": args.minutes, "seed": args.seed, "produced": len(w.ids), "written": len(rows),
            "lost": len(ids - set(written)), "duplicates": len(written) - len(set(written)),
            "duplicatesAfter": dict(why), "unexplainedDuplicates": unexplained,
            # the batches that wrote them again, with when they ended (s after the soak's start)
            "unexplainedBy": [{"run": r, "batch": b, "count": n, "t": round(done_at.get((r, b), 0.0) - sampler.wall0, 1)}
                              for (r, b), n in where.most_common(30)],
            "memberJoins": len(joins), "unexplainedWithinEffectOfAJoin": after_join,
            "driverRuns": driver.runs, "driverEnds": driver.ended, "finalError": res.get("error"),
            "batches": len(batches), "agentsLeft": {h: len(p) for h, p in agents_left.items()},
            "membersLeft": len(members_left),
            "faultsByKind": dict(Counter(f.kind for f in faults)), "faults": [asdict(f) for f in faults],
            "growth": [asdict(v) for v in verdicts],
        }
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(summary, f, indent=1)
        resources.save(samples, os.path.join(args.out, "resources.json"))
        events = [{"t": f.started - sampler.wall0} for f in faults if f.started]
        if samples:
            resources.plot(samples, os.path.join(args.out, "resources.png"), events,
                           title=f"cluster soak, {args.minutes:.0f} min, seed {args.seed} (grey: faults)")
        for v in verdicts:
            print(v.line())
        print(json.dumps({k: v for k, v in summary.items() if k not in ("faults", "growth")}, indent=1))
        ok = (summary["lost"] == 0 and unexplained == 0 and not any(agents_left.values()) and not members_left
              and res.get("error") is None and (not args.judge_growth or not any(v.grows for v in verdicts)))
        print("soak: PASSED" if ok else "soak: FAILED", flush=True)
        return 0 if ok else 1
    finally:
        if operator is not None:
            operator.stop()
        if producer is not None:
            producer.stop()
        if sampler is not None:
            sampler.stop()
        cluster.stop()
        kafka.close()


if __name__ == "__main__":
    sys.exit(main())
