"""CPU accounting of a benchmark run's processes: a sampler thread that reads the CPU seconds of
spark-share's processes (agents, the source runner, Python workers), Spark's JVM and this process while a
run lasts, and the sums the scripts report (per process kind, per side, of given processes).

It must never count a process's CPU from before the run (processes started during it count from zero)
and never change a process: it only reads /proc through psutil. It tells processes apart by kind, not by
run: every agent, Spark JVM or Python worker on the machine counts, so a benchmark runs alone.
"""
from __future__ import annotations

import contextlib
import threading
import time

import bench_common  # noqa: F401  (puts tests/ on the path for the harness)
import psutil

from harness.resources import process_kind

OURS = ("agent", "runner", "python workers")
# This process: the embedded broker's thread runs here, and py4j; on a real Kafka only py4j (the name is
# kept: it is a key of the results files).
BROKER = "this process (embedded broker, py4j)"


class Sampler:
    """A thread that calls ``sample()`` every ``interval`` seconds while the ``with`` lasts."""

    interval = 0.2

    def __init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def sample(self) -> None:
        raise NotImplementedError

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class CpuSampler(Sampler):
    """CPU seconds of the processes of a run while it lasts: ours (agents, the runner, Python
    workers), and for context Spark's JVM and this process (the embedded broker's thread, py4j).
    Processes started during the run count from zero; the process list is read twice a second,
    CPU times five times a second (the sampler itself competes for the same 2 cores)."""

    def __init__(self):
        super().__init__()
        self.last = {}
        self.first = {}
        self.kind = {}
        self.procs = {}
        self._started = time.time()
        self._tick = 0

    @staticmethod
    def ours(p):
        kind = process_kind(p)
        return {"driver": BROKER, "JVM": "JVM (Spark driver and executor)"}.get(kind, kind) if kind else None

    def _scan(self):
        for p in psutil.process_iter(["cmdline", "create_time"]):
            if p.pid in self.procs:
                continue
            try:
                kind = self.ours(p)
            except psutil.Error:
                continue
            if kind:
                self.procs[p.pid] = p
                self.kind[p.pid] = kind
                if p.info["create_time"] >= self._started:
                    self.first[p.pid] = 0.0

    def sample(self) -> None:
        if self._tick % 3 == 0:
            self._scan()
        self._tick += 1
        for pid, p in list(self.procs.items()):
            try:
                t = p.cpu_times()
            except psutil.Error:
                del self.procs[pid]
                continue
            v = t.user + t.system
            self.first.setdefault(pid, v)
            self.last[pid] = v

    @property
    def seconds(self):
        """CPU seconds of spark-share's own processes (agents, the runner, Python workers)."""
        return sum(self.last[p] - self.first.get(p, 0) for p in self.last if self.kind[p] in OURS)

    @property
    def by_kind(self):
        out = {}
        for p in self.last:
            out[self.kind[p]] = out.get(self.kind[p], 0) + self.last[p] - self.first.get(p, 0)
        return out


def side_cpu_per_m(cpu: dict, kinds: tuple[str, ...], records: int) -> float:
    """CPU seconds per million records of the process kinds ``kinds`` in ``cpu`` (a ``by_kind``)."""
    return sum(v for k, v in cpu.items() if k in kinds) / max(records, 1) * 1e6


def cpu_seconds(processes) -> float:
    """CPU seconds (user + system) the given processes (pids or psutil processes) have used so far; one that
    has ended counts 0."""
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            t = (p if isinstance(p, psutil.Process) else psutil.Process(p)).cpu_times()
            total += t.user + t.system
    return total
