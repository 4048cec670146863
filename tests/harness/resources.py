"""Resources of a run over time: sampling, the growth verdict, and the plot.

Owns: which processes belong to a run and of what kind (``process_kind``: the driver, Spark's JVM,
agents, the source runner, Python workers), sampling them (RSS, open files, threads, sockets) with
the runtime directory, the logs and the checkpoint every few seconds (``ResourceSampler``), the
verdict that fails a run when a series keeps growing after warm-up (``growth_verdict``: a slope
test over the whole window, not a threshold on one sample), and ``plot``.

Must never: signal or otherwise touch the processes it samples, or count another program's.
Used by tests/harness/chaos.py and benchmarks/bench_cpu.py; not part of the package.
"""
from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass

import psutil

KINDS = ("driver", "JVM", "runner", "agent", "python workers", "executor JVM", "Spark daemons")
METRICS = ("rss_mib", "fds", "threads", "sockets")


def process_kind(p: psutil.Process, driver_pid: int | None = None) -> str | None:
    """What a process of a run is (None: not one of ours or Spark's)."""
    if p.pid == (driver_pid if driver_pid is not None else os.getpid()):
        return "driver"
    cmd = " ".join(p.cmdline() or [])
    if "org.apache.spark.deploy.SparkSubmit" in cmd:
        return "JVM"
    if "CoarseGrainedExecutorBackend" in cmd:  # a cluster's executors (local mode has none)
        return "executor JVM"
    if "org.apache.spark.deploy.master.Master" in cmd or "org.apache.spark.deploy.worker.Worker" in cmd:
        return "Spark daemons"
    for needle, kind in (("spark_share.consumers.agent", "agent"), ("python_streaming_source_runner", "runner"),
                         ("pyspark.daemon", "python workers"), ("pyspark/daemon", "python workers"),
                         ("pyspark.worker", "python workers")):
        if needle in cmd:
            return kind
    return None


def run_processes(root_pid: int, runtime_dir: str) -> dict[int, tuple[str, psutil.Process]]:
    """The driver process ``root_pid``, everything it started, and the agents of the run whose runtime
    directory is ``runtime_dir`` (they detach from the worker that spawned them, work in its Spark local
    dir, and inherit its environment)."""
    out = {}
    try:
        root = psutil.Process(root_pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = []
    for p in tree:
        try:
            kind = process_kind(p, root_pid)
        except psutil.Error:
            continue
        if kind:
            out[p.pid] = (kind, p)
    for p in psutil.process_iter(["cmdline"]):
        try:
            if ("spark_share.consumers.agent" in " ".join(p.info["cmdline"] or [])
                    and p.environ().get("SPARK_SHARE_RUNTIME_DIR") == runtime_dir):
                out[p.pid] = ("agent", p)
        except psutil.Error:
            continue
    return out


# Spark's cached thread pools with a fixed cap (BlockManagerMasterEndpoint's ask pool and
# BlockManagerStorageEndpoint's async pool, 100 threads each), by the names Linux keeps (15 chars).
# Under load a burst of block removals fills them, at any moment of a run, and idle threads are
# kept for 60 s: a step up to the cap, never a leak. Sampled apart, not judged.
BOUNDED_SPARK_POOLS = ("block-manager-a", "block-manager-s")


def _bounded_pool_threads(pid: int) -> int:
    n = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                n += f.read().startswith(BOUNDED_SPARK_POOLS)
        except OSError:
            continue
    return n


def _fds(pid: int) -> tuple[int, int]:
    """(open file descriptors, of which sockets) of a process."""
    fds = socks = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            fds += 1
            try:
                socks += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            except OSError:
                pass
    except OSError:
        pass
    return fds, socks


def files_under(path: str, logs: bool | None = None) -> tuple[int, int]:
    """(files, bytes) under ``path``; ``logs`` True: only log files, False: all but log files."""
    files = size = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            is_log = name.endswith(".log") or ".log." in name
            if logs is not None and is_log != logs:
                continue
            try:
                size += os.stat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                pass
    return files, size


def measure(processes: dict[int, tuple[str, psutil.Process]]) -> dict[str, dict]:
    """Per process kind: the number of ``processes`` of that kind and their sums of RSS (MiB), open
    files, threads (a JVM's without Spark's bounded pools, counted apart) and sockets."""
    kinds: dict[str, dict] = {k: {"n": 0, "rss_mib": 0.0, "fds": 0, "threads": 0, "sockets": 0} for k in KINDS}
    for pid, (kind, p) in processes.items():
        try:
            with p.oneshot():
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                rss, threads = p.memory_info().rss, p.num_threads()
        except psutil.Error:
            continue
        fds, socks = _fds(pid)
        k = kinds[kind]
        k["n"] += 1
        k["rss_mib"] += rss / 2**20
        k["fds"] += fds
        if kind in ("JVM", "executor JVM"):
            pooled = _bounded_pool_threads(pid)
            k["bounded_pool_threads"] = k.get("bounded_pool_threads", 0) + pooled
            threads -= pooled
        k["threads"] += threads
        k["sockets"] += socks
    return kinds


class ResourceSampler:
    """Samples a run (the driver process ``driver_pid`` and what belongs to it) every ``interval`` s
    on its own thread until ``stop()``.

    Each sample: ``t`` (s since start); per process kind the number of processes and the sums of
    RSS (MiB), open files, threads and sockets; the runtime directory (files, bytes, without logs),
    the logs (bytes: the runtime directory's and ``extra_logs``), the checkpoint (files)."""

    def __init__(self, driver_pid: int, runtime_dir: str, checkpoint: str, interval: float = 5.0,
                 extra_logs: tuple[str, ...] = (), py4j_counts: str | None = None, query_events: str | None = None):
        self.driver_pid = driver_pid
        self.py4j_counts = py4j_counts
        self.query_events = query_events
        self.runtime_dir = runtime_dir
        self.checkpoint = checkpoint
        self.interval = interval
        self.extra_logs = extra_logs
        self.samples: list[dict] = []
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resource-sampler", daemon=True)

    def start(self) -> ResourceSampler:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join()
        return self.samples

    def _loop(self) -> None:
        while True:
            self.samples.append(self.sample())
            if self._stop.wait(self.interval):
                return

    def sample(self) -> dict:
        kinds = measure(run_processes(self.driver_pid, self.runtime_dir))
        files, size = files_under(self.runtime_dir, logs=False)
        _, log_bytes = files_under(self.runtime_dir, logs=True)
        for path in self.extra_logs:
            try:
                log_bytes += os.stat(path).st_size
            except OSError:
                pass
        ck_files, _ = files_under(self.checkpoint)
        out = {"t": round(time.monotonic() - self._t0, 2), "kinds": kinds,
               "runtime_files": files, "runtime_bytes": size, "log_bytes": log_bytes, "checkpoint_files": ck_files}
        if self.py4j_counts:
            try:
                with open(self.py4j_counts) as f:
                    out["py4j_connections"] = int(json.load(f)["py4j_connections"])
            except (OSError, ValueError, KeyError):
                pass
        if self.query_events:
            out["query_runs"] = query_runs(self.query_events)
        return out


# --- the verdict -----------------------------------------------------------------------------------
# A series "keeps growing" when, after warm-up, both its Theil-Sen slope over the window and the
# difference between the medians of its last and first thirds exceed the tolerance: a step (a
# session started once, a process restarted) or one noisy sample does not fail a run; a leak does.
ABS_TOLERANCE = {"rss_mib": 48.0, "fds": 16, "threads": 8, "sockets": 16, "n": 2,
                 "runtime_files": 8, "runtime_bytes": 1 << 20, "checkpoint_files": 64}
REL_TOLERANCE = 0.15  # of the series' median level
PER_KIND_RSS_REL = {"JVM": 0.25}  # the JVM's heap settles later than our processes' memory


@dataclass
class SeriesVerdict:
    name: str
    first: float  # median of the first third after warm-up
    last: float  # median of the last third
    slope_per_hour: float
    growth: float  # slope x window
    tolerance: float
    grows: bool

    def line(self) -> str:
        return (f"{self.name:<32} {self.first:>10.1f} -> {self.last:>10.1f}  slope {self.slope_per_hour:>+10.1f}/h  "
                f"growth {self.growth:>+9.1f} (tolerance {self.tolerance:.1f}){'  GROWS' if self.grows else ''}")


def theil_sen(ts: list[float], ys: list[float]) -> float:
    """The median of the slopes between every pair of samples (robust to outliers and steps)."""
    slopes = [(ys[j] - ys[i]) / (ts[j] - ts[i]) for i in range(len(ts)) for j in range(i + 1, len(ts))
              if ts[j] > ts[i]]
    return statistics.median(slopes) if slopes else 0.0


def query_runs(events_path: str) -> int:
    """Query runs started so far, from the query process's event lines."""
    try:
        with open(events_path) as f:
            return sum('"started"' in line for line in f)
    except OSError:
        return 0


# What Spark and py4j keep per query run in the driver and its JVM, measured in the 60-minute soak
# (see docs/guarantees.md, Soak and chaos): py4j, in pinned-thread mode (pyspark's default), keeps the callback connection
# of every JVM thread that called into Python, and a Python thread serving it, after the JVM thread
# ended: each run's stream thread calls foreachBatch. The JVM keeps two sockets per run, the epoll
# and event descriptors of a selector (two anon_inode fds), and an idle worker monitor thread: the
# same for a Python streaming source that is not ours (benchmarks/spark_run_cost.py: 4 JVM fds per run
# with Spark's floor source, 1 with the rate source). These are taken off the driver's and JVM's
# counts before judging, so the verdict sees what grows apart from query restarts (a run of ours
# restarts every ~40 s).
PER_QUERY_RUN = {"driver": {"threads": 1, "sockets": 1, "fds": 1}, "JVM": {"threads": 1, "sockets": 2, "fds": 4}}


def series(samples: list[dict]) -> dict[str, tuple[str, list[float], list[float]]]:
    """name -> (metric, times, values) of every sampled series (driver and JVM counts without what Spark
    and py4j keep per query run, when the samples know the runs: see PER_QUERY_RUN). A kind's RSS,
    files, threads and sockets count only samples in which it had a process: the runner and the agent
    are gone between two runs of the query, and an absent process is no 0 MiB to grow from."""
    out: dict[str, tuple[str, list[float], list[float]]] = {}
    runs = [s.get("query_runs", 0) for s in samples]
    ts = [s["t"] for s in samples]
    for kind in KINDS:
        for metric in (*METRICS, "n"):
            per_run = PER_QUERY_RUN.get(kind, {}).get(metric, 0)
            points = [(t, s["kinds"][kind][metric] - per_run * r) for t, s, r in zip(ts, samples, runs)
                      if metric == "n" or s["kinds"][kind]["n"]]
            out[f"{kind} {metric}"] = (metric, [t for t, _ in points], [v for _, v in points])
    for name in ("runtime_files", "runtime_bytes", "checkpoint_files"):
        out[name] = (name, ts, [s[name] for s in samples])
    return out


def growth_verdict(samples: list[dict], warmup_s: float) -> list[SeriesVerdict]:
    """A verdict per series over the samples taken after ``warmup_s``. Logs are not judged here:
    they grow with what happens (every fault writes lines) and are bounded by rotation and
    retention instead."""
    kept = [s for s in samples if s["t"] >= warmup_s]
    if len(kept) < 6:
        raise ValueError(f"{len(kept)} samples after a {warmup_s:.0f} s warm-up: too few to judge growth; "
                         "run longer or sample more often")
    out = []
    for name, (metric, ts, values) in series(kept).items():
        if len(ts) < 6:  # a kind that hardly ran after the warm-up: nothing to judge
            continue
        window = ts[-1] - ts[0]
        ys = [float(v) for v in values]
        third = max(2, len(ys) // 3)
        first, last = statistics.median(ys[:third]), statistics.median(ys[-third:])
        slope = theil_sen(ts, ys)
        rel = PER_KIND_RSS_REL.get(name.split(" ")[0], REL_TOLERANCE) if metric == "rss_mib" else REL_TOLERANCE
        tol = max(ABS_TOLERANCE[metric], rel * statistics.median(ys))
        growth = slope * window
        out.append(SeriesVerdict(name, first, last, slope * 3600, growth, tol,
                                 grows=growth > tol and last - first > tol / 2))
    return out


def at(samples: list[dict], t: float) -> dict:
    """The sample nearest to ``t`` s after the start."""
    return min(samples, key=lambda s: abs(s["t"] - t))


def plot(samples: list[dict], path: str, events: list[dict] = (), title: str = "") -> None:
    """RSS, open files, threads and sockets per process kind, and the runtime directory, logs and
    checkpoint, against time; faults as ticks along the top of each panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 2, figsize=(13, 11), sharex=True)
    panels = [("rss_mib", "RSS (MiB)"), ("fds", "open files"), ("threads", "threads"), ("sockets", "sockets")]
    for ax, (metric, label) in zip(axes.flat, panels):
        for kind in KINDS:
            ax.plot(ts, [s["kinds"][kind][metric] for s in samples], label=kind, lw=1)
        ax.set_ylabel(label)
    ax = axes.flat[4]
    ax.plot(ts, [s["runtime_files"] for s in samples], label="runtime dir files")
    ax.plot(ts, [s["checkpoint_files"] for s in samples], label="checkpoint files")
    ax.set_ylabel("files")
    ax = axes.flat[5]
    ax.plot(ts, [s["log_bytes"] / 2**20 for s in samples], label="logs (MiB)")
    ax.plot(ts, [s["runtime_bytes"] / 2**20 for s in samples], label="runtime dir without logs (MiB)")
    ax.set_ylabel("MiB")
    for ax in axes.flat:
        for e in events:
            ax.axvline(e["t"] / 60, color="grey", alpha=0.15, lw=0.8)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle(title or "resources over time (grey: faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save(samples: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(samples, f)
