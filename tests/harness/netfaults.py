"""Network faults on a NamespaceCluster's hosts: a host's link cut and restored, one host cut off from some
others, and delay and loss on a host's link.

This kernel has no ``netem`` qdisc (``tc qdisc add ... netem`` says "Specified qdisc kind is unknown"), so
delay and loss are made with what it has: loss with iptables' ``statistic`` match dropping a share of the
host's packets, both ways; delay with NFQUEUE, every packet the host sends held by a small program in the
host's namespace (``python netfaults.py delay QUEUE SECONDS``, NetfilterQueue) for that long, then let go.
Cuts take the host's link down (``ip link set eth0 down`` in its namespace) or drop its packets to given
addresses.

Owns: the rules and processes it adds, and removing them (``clear``), by pid and by its own chains only.
Needs root, iptables and NetfilterQueue (``.ci/run`` installs them; without them it fails saying so).
"""
from __future__ import annotations

import heapq
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: this file also runs as the delayer, inside a host, without the harness
    from harness.spark_hosts import NamespaceCluster


def _in(cluster: NamespaceCluster, host: str, *argv: str) -> None:
    out = subprocess.run(["ip", "netns", "exec", cluster.ns(host), *argv], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} on {host} failed ({out.returncode}): {out.stderr.strip()}")


class NetFaults:
    """Faults on the hosts of ``cluster``; ``clear()`` (or leaving the ``with``) removes every one."""

    def __init__(self, cluster: NamespaceCluster):
        if shutil.which("iptables") is None:
            raise RuntimeError("the network-fault tests need iptables (Debian: apt-get install iptables)")
        self.cluster = cluster
        self._delayers: dict[str, subprocess.Popen] = {}
        self._touched: set[str] = set()
        self._down: set[str] = set()

    def __enter__(self) -> NetFaults:
        return self

    def __exit__(self, *exc) -> None:
        self.clear()

    def cut(self, host: str) -> None:
        """``host``'s link goes down: nothing reaches it or leaves it (a network partition of one host)."""
        _in(self.cluster, host, "ip", "link", "set", "eth0", "down")
        self._down.add(host)

    def restore(self, host: str) -> None:
        _in(self.cluster, host, "ip", "link", "set", "eth0", "up")
        self._down.discard(host)

    def isolate(self, host: str, others: list[str]) -> None:
        """Packets between ``host`` and ``others`` are dropped, both ways (the rest of its traffic flows)."""
        for other in others:
            ip = self.cluster.hosts[other]
            _in(self.cluster, host, "iptables", "-A", "INPUT", "-s", ip, "-j", "DROP")
            _in(self.cluster, host, "iptables", "-A", "OUTPUT", "-d", ip, "-j", "DROP")
        self._touched.add(host)

    def impair(self, host: str, delay_s: float = 0.0, loss: float = 0.0, queue: int = 7) -> None:
        """Every packet ``host`` sends is held ``delay_s``; ``loss`` of its packets, each way, are dropped."""
        if loss:
            for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
                _in(self.cluster, host, "iptables", "-A", chain, way, "eth0", "-m", "statistic", "--mode", "random",
                    "--probability", str(loss), "-j", "DROP")
        if delay_s:
            try:
                import netfilterqueue  # noqa: F401
            except ImportError:
                raise RuntimeError("the delay fault needs NetfilterQueue: apt-get install libnetfilter-queue-dev, then "
                                   ".venv/bin/pip install NetfilterQueue (.ci/run does both)") from None
            p = subprocess.Popen(["ip", "netns", "exec", self.cluster.ns(host), sys.executable, os.path.abspath(__file__),
                                  "delay", str(queue), str(delay_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
            line = p.stdout.readline() if p.stdout else ""  # the delayer says "ready" once its queue is bound
            if line.strip() != "ready":
                p.kill()
                raise RuntimeError(f"the delayer did not start on {host}: {line} {p.stderr.read() if p.stderr else ''}")
            self._delayers[host] = p
            _in(self.cluster, host, "iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", str(queue))
        self._touched.add(host)

    def clear(self, host: str | None = None) -> None:
        """Remove the faults (of ``host``, or of every host)."""
        for h in [host] if host else list(self._touched | self._down | set(self._delayers)):
            if h in self._touched:
                for chain in ("INPUT", "OUTPUT"):
                    subprocess.run(["ip", "netns", "exec", self.cluster.ns(h), "iptables", "-F", chain],
                                   capture_output=True)
                self._touched.discard(h)
            if h in self._down:
                self.restore(h)
            p = self._delayers.pop(h, None)
            if p is not None:  # after the rule that feeds it is gone: no packet is left waiting in its queue
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                p.wait(10)


def _delay(queue: int, delay_s: float) -> None:
    """Hold every packet the queue gets for ``delay_s``, then let it go, in order (run inside a host)."""
    import socket

    from netfilterqueue import NetfilterQueue

    held: list = []
    lock = threading.Lock()
    due = threading.Condition(lock)
    seq = 0

    def on_packet(pkt) -> None:
        nonlocal seq
        with lock:
            seq += 1
            heapq.heappush(held, (time.monotonic() + delay_s, seq, pkt))
            due.notify()

    def release() -> None:
        with lock:
            while True:
                now = time.monotonic()
                while held and held[0][0] <= now:
                    heapq.heappop(held)[2].accept()
                due.wait(held[0][0] - now if held else None)

    q = NetfilterQueue()
    q.bind(queue, on_packet, max_len=100_000)
    threading.Thread(target=release, daemon=True).start()
    sock = socket.fromfd(q.get_fd(), socket.AF_UNIX, socket.SOCK_STREAM)
    print("ready", flush=True)
    try:
        q.run_socket(sock)
    finally:
        q.unbind()


if __name__ == "__main__":
    if sys.argv[1:2] == ["delay"]:
        _delay(int(sys.argv[2]), float(sys.argv[3]))
