"""What the channel between our processes costs: TLS (spark_share.transport.wire) against the
HMAC-SHA256 channel it replaced and against plain framing with no protection, side by side in one run.

No Spark, no broker: a server and a client in this process, on TCP loopback and on a Unix socket.
Measures one ~200-byte frame sent and received in one thread (the channel's own cost per frame),
a small RPC's round trip (a ~200-byte header, median), throughput of 1 MB and 8 MB blobs (the agent
answering a read task: MB/s, and CPU-seconds per GB from ``time.process_time`` of this process, so
both ends), and the time to set up a connection. The channels take turns over a few rounds, so a
busy machine's drift hits all alike. Prints each figure and its ratio to the old channel.

The old channel is wire.py as of ``BASELINE`` (``git show``, loaded from a temporary copy), so this
runs in a git checkout of spark-share. Plain framing is wire.py's frames and RPC over the bare
socket (what a Unix socket protected by file permissions alone would cost).

    python benchmarks/wire_cost.py [--calls 5000] [--mb 256] [--rounds 4]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from spark_share.transport import tls, wire

BASELINE = "da96ff6"  # the last commit with the HMAC channel (per-frame tags, optional AES-CTR)
SECRET = wire.new_secret()


def load_old_wire():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(["git", "-C", root, "show", f"{BASELINE}:spark_share/transport/wire.py"],
                            check=True, capture_output=True).stdout
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as f:
        f.write(source)
    try:
        spec = importlib.util.spec_from_file_location("spark_share.transport.wire_hmac", f.name)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.unlink(f.name)
    return module


class PlainStream:
    """tls.TlsStream's interface over the bare socket: frames, no protection."""

    def __init__(self, sock):
        self.sock, self._lock = sock, threading.Lock()

    def sendall(self, *parts):
        with self._lock:
            for part in parts:
                self.sock.sendall(part)

    def recv_into(self, view, n):
        return self.sock.recv_into(view, n)

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class PlainServer:
    def __init__(self, address, handler):
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind(address)
        self._sock.listen(16)
        self.address = address if isinstance(address, str) else self._sock.getsockname()
        self._handler, self._conns = handler, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if conn.family == socket.AF_INET:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(wire.RpcConnection(PlainStream(conn), self._handler, workers=8))

    def close(self):
        self._sock.close()
        for c in self._conns:
            c.close()


def plain_connect(address):
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.connect(address)
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return wire.RpcConnection(PlainStream(sock))


def channels(old):
    """name -> (start a server at an address with a handler, connect to an address)."""
    return {
        "old": (lambda a, h: old.RpcServer(a, SECRET, h), lambda a: old.connect(a, SECRET)),
        "tls": (lambda a, h: wire.RpcServer(a, SECRET, h), lambda a: wire.connect(a, SECRET)),
        "plain": (PlainServer, plain_connect),
    }


def connected_pair(where):
    if where == "uds":
        return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname()[:2])
        b, _ = listener.accept()
    for sock in (a, b):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def frame_cost(name, where, old, frames: int) -> float:
    """Microseconds to send and receive one ~200-byte frame in one thread: the channel's own cost
    per frame, without the thread hand-offs of an RPC."""
    a, b = connected_pair(where)
    header = {"op": "status", "pad": "x" * 170, "_id": 1, "_kind": "req"}
    if name == "old":
        keys = {}
        t = threading.Thread(target=lambda: keys.setdefault("server", old.server_handshake(b, SECRET)))
        t.start()
        client_keys = old.client_handshake(a, SECRET)
        t.join()
        lock = threading.Lock()

        def one():
            old.send_frame(a, header, b"", client_keys[0], lock)
            old.recv_frame(b, keys["server"][1])
    else:
        if name == "tls":
            streams = {}
            t = threading.Thread(target=lambda: streams.setdefault("b", tls.admit(b, SECRET, server_side=True)))
            t.start()
            sa = tls.admit(a, SECRET, server_side=False)
            t.join()
            sb = streams["b"]
        else:
            sa, sb = PlainStream(a), PlainStream(b)

        def one():
            wire.send_frame(sa, header, b"")
            wire.recv_frame(sb)
    for _ in range(200):
        one()
    t0 = time.perf_counter()
    for _ in range(frames):
        one()
    elapsed = time.perf_counter() - t0
    a.close()
    b.close()
    return elapsed / frames * 1e6


def measure(start, dial, address, calls: int, total_mb: int, into: dict) -> None:
    """One round on one channel and socket, its samples added to ``into``."""
    blobs = {1: os.urandom(1 << 20), 8: os.urandom(8 << 20)}

    def handler(conn, req, blob):
        return {"ok": 1}, blobs.get(req.get("mb"), b"")

    srv = start(address, handler)
    address = srv.address
    try:
        c = dial(address)
        header = {"op": "status", "pad": "x" * 170}  # ~200 bytes on the wire
        for _ in range(100):
            c.call(header, timeout=10)
        for _ in range(calls):
            t = time.perf_counter()
            c.call(header, timeout=10)
            into.setdefault("rtt", []).append(time.perf_counter() - t)
        for mb in (1, 8):
            n = max(2, total_mb // mb)
            c.call({"op": "read", "mb": mb}, timeout=30)
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(n):
                _, blob = c.call({"op": "read", "mb": mb}, timeout=30)
                assert len(blob) == mb << 20
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            for key, value in (("mb", n * mb), ("wall", wall), ("cpu", cpu)):
                into[f"{key}_{mb}"] = into.get(f"{key}_{mb}", 0) + value
        c.close()
        for _ in range(40):
            t = time.perf_counter()
            c = dial(address)
            c.call({"op": "x"}, timeout=10)  # admitted: the first call answered
            into.setdefault("setup", []).append(time.perf_counter() - t)
            c.close()
    finally:
        srv.close()


def figures(samples: dict) -> dict:
    out = {"frame_us": statistics.median(samples["frame"]), "rtt_us": statistics.median(samples["rtt"]) * 1e6,
           "setup_ms": statistics.median(samples["setup"]) * 1e3}
    for mb in (1, 8):
        out[f"mbps_{mb}"] = samples[f"mb_{mb}"] / samples[f"wall_{mb}"]
        out[f"cpu_gb_{mb}"] = samples[f"cpu_{mb}"] / (samples[f"mb_{mb}"] / 1024)
    return out


FIGURES = [("frame_us", "frame sent + received, one thread (us)"), ("rtt_us", "RPC round trip, median (us)"), ("mbps_1", "1 MB blobs (MB/s)"),
           ("mbps_8", "8 MB blobs (MB/s)"), ("cpu_gb_1", "1 MB blobs (CPU-s/GB)"),
           ("cpu_gb_8", "8 MB blobs (CPU-s/GB)"), ("setup_ms", "connection setup + first call (ms)")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=5000, help="small RPCs timed per channel and socket")
    p.add_argument("--mb", type=int, default=256, help="MB of blobs moved per blob size, channel and socket")
    p.add_argument("--rounds", type=int, default=4, help="the channels take turns this many times (drift hits all alike)")
    args = p.parse_args(argv)
    old = load_old_wire()
    samples: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (start, dial) in channels(old).items():
                for where, address in (("tcp", ("127.0.0.1", 0)), ("uds", os.path.join(tmp, f"{name}-{r}.sock"))):
                    into = samples.setdefault((name, where), {})
                    into.setdefault("frame", []).append(frame_cost(name, where, old, args.calls))
                    measure(start, dial, address, args.calls // args.rounds, args.mb // args.rounds, into)
            print(f"round {r + 1} of {args.rounds} measured", file=sys.stderr)
    results = {k: figures(v) for k, v in samples.items()}
    print(f"python {sys.version.split()[0]}, {tls.ssl.OPENSSL_VERSION}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}")
    for where in ("uds", "tcp"):
        print(f"\n{'Unix socket' if where == 'uds' else 'TCP loopback'}")
        print(f"  {'':38} {'old':>9} {'tls':>9} {'plain':>9} {'tls/old':>8} {'plain/old':>9}")
        for key, label in FIGURES:
            o, t, n = (results[c, where][key] for c in ("old", "tls", "plain"))
            print(f"  {label:38} {o:9.2f} {t:9.2f} {n:9.2f} {t / o:8.2f} {n / o:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
