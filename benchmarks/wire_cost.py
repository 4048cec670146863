"""What the channel between our processes costs: the wire on one selector loop per process
(spark_share.transport.wire, now) against the thread-per-connection wire it replaced, side by side in
one run.

No Spark, no broker: a server and a client in this process, on TCP loopback and on a Unix socket, both
channels TLS 1.3 with the query's certificate. Measures a small RPC's round trip (a ~200-byte header,
median), throughput of 1 MB and 8 MB blobs (the agent answering a read task: MB/s, and CPU-seconds per
GB from ``time.process_time`` of this process, so both ends), the time to set up a connection, and the
threads of the process with ``--peers`` idle connections open to one server (a tracker's agents). The
channels take turns over a few rounds, so a busy machine's drift hits both alike. Prints each figure
and its ratio to the old channel.

The old channel is transport/wire.py and tls.py as of ``BASELINE`` (``git show``, loaded from temporary
copies), so this runs in a git checkout of spark-share. It must never write into the package: the old
files live only in temporary copies, removed once loaded.

    python benchmarks/wire_cost.py [--calls 3000] [--mb 128] [--rounds 3] [--peers 200]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

from spark_share.transport import endpoints, tls, wire

BASELINE = "3639409"  # the last commit with a reader thread per connection and a thread per handshake
SECRET = wire.new_secret()


def load_old_wire():
    """wire.py and tls.py of BASELINE as spark_share.transport.threaded_{wire,tls} (their imports of
    spark_share.errors and spark_share.runtime are today's: both kept what those files use)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    modules = {}
    for name in ("tls", "wire"):
        source = subprocess.run(["git", "-C", root, "show", f"{BASELINE}:spark_share/transport/{name}.py"],
                                check=True, capture_output=True, text=True).stdout
        source = source.replace("from .tls import", "from .threaded_tls import")
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(source)
        try:
            spec = importlib.util.spec_from_file_location(f"spark_share.transport.threaded_{name}", f.name)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        finally:
            os.unlink(f.name)
        modules[name] = module
    return modules["wire"]


def measure(impl, address, calls: int, total_mb: int, peers: int, into: dict) -> None:
    """One round on one channel and socket, its samples added to ``into``."""
    blobs = {1: os.urandom(1 << 20), 8: os.urandom(8 << 20)}

    def handler(conn, req, blob):
        return {"ok": 1}, blobs.get(req.get("mb"), b"")

    srv = impl.RpcServer(address, SECRET, handler)
    address = srv.address
    try:
        c = impl.connect(address, SECRET)
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
        for _ in range(20):
            t = time.perf_counter()
            c = impl.connect(address, SECRET)
            c.call({"op": "x"}, timeout=10)  # admitted: the first call answered
            into.setdefault("setup", []).append(time.perf_counter() - t)
            c.close()
        if peers:
            before = threading.active_count()
            conns = [impl.connect(address, SECRET) for _ in range(peers)]
            for p in conns:
                p.call({"op": "x"}, timeout=30)
            into.setdefault("threads", []).append(threading.active_count() - before)
            for p in conns:
                p.close()
    finally:
        srv.close()


def figures(samples: dict) -> dict:
    out = {"rtt_us": statistics.median(samples["rtt"]) * 1e6, "setup_ms": statistics.median(samples["setup"]) * 1e3}
    for mb in (1, 8):
        out[f"mbps_{mb}"] = samples[f"mb_{mb}"] / samples[f"wall_{mb}"]
        out[f"cpu_gb_{mb}"] = samples[f"cpu_{mb}"] / (samples[f"mb_{mb}"] / 1024)
    if samples.get("threads"):
        out["threads"] = max(samples["threads"])
    return out


FIGURES = [("rtt_us", "RPC round trip, median (us)"), ("mbps_1", "1 MB blobs (MB/s)"),
           ("mbps_8", "8 MB blobs (MB/s)"), ("cpu_gb_1", "1 MB blobs (CPU-s/GB)"),
           ("cpu_gb_8", "8 MB blobs (CPU-s/GB)"), ("setup_ms", "connection setup + first call (ms)")]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=3000, help="small RPCs timed per channel and socket")
    p.add_argument("--mb", type=int, default=128, help="MB of blobs moved per blob size, channel and socket")
    p.add_argument("--rounds", type=int, default=3, help="the channels take turns this many times")
    p.add_argument("--peers", type=int, default=200, help="idle connections held open to count threads")
    args = p.parse_args(argv)
    # today the server and connect() live in endpoints.py, beside wire.py
    channels = {"old": load_old_wire(), "loop": SimpleNamespace(RpcServer=endpoints.RpcServer, connect=endpoints.connect)}
    samples: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, impl in channels.items():
                for where, address in (("tcp", ("127.0.0.1", 0)), ("uds", os.path.join(tmp, f"{name}-{r}.sock"))):
                    measure(impl, address, args.calls // args.rounds, args.mb // args.rounds,
                            args.peers if where == "tcp" else 0, samples.setdefault((name, where), {}))
            print(f"round {r + 1} of {args.rounds} measured", file=sys.stderr)
    results = {k: figures(v) for k, v in samples.items()}
    print(f"python {sys.version.split()[0]}, {tls.ssl.OPENSSL_VERSION}, {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}")
    for where in ("uds", "tcp"):
        print(f"\n{'Unix socket' if where == 'uds' else 'TCP loopback'}")
        print(f"  {'':38} {'old':>9} {'loop':>9} {'loop/old':>9}")
        rows = FIGURES + ([("threads", f"threads for {args.peers} connections")] if where == "tcp" and args.peers else [])
        for key, label in rows:
            o, n = (results[c, where][key] for c in ("old", "loop"))
            print(f"  {label:38} {o:9.2f} {n:9.2f} {n / o if o else float('nan'):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
