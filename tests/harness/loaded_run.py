"""A test run on a busy machine: ``--busy`` processes spinning at normal priority beside it for the
whole run (two by default: on 2 cores, the suite then gets about half the CPU it gets alone). Tests
assert guarantees, not the machine's speed: the real pass must pass like this too (docs/testing.md
records the counts). Not run by CI.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python tests/harness/loaded_run.py   # the real pass
    .venv/bin/python tests/harness/loaded_run.py -- tests/integration/test_cluster.py -k host_lost

Arguments after ``--`` go to pytest (default: tests/integration, the real pass's selection). The real
pass runs on a broker started from ``KAFKA_HOME`` (or ``SPARK_SHARE_TEST_KAFKA_START``), or on
``SPARK_SHARE_TEST_BOOTSTRAP``. Exit code: pytest's (5, no tests, counts as a failure).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spin(stop) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(100_000):
            n += 1


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside the run (default 2)")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: tests/integration)")
    args = ap.parse_args(argv)
    env = dict(os.environ, SPARK_SHARE_TEST_REAL_PASS="1")
    if not any(env.get(v) for v in ("SPARK_SHARE_TEST_BOOTSTRAP", "SPARK_SHARE_TEST_KAFKA_START", "KAFKA_HOME")):
        ap.error("no real Kafka given: set KAFKA_HOME (an unpacked Apache Kafka >= 4.2) or SPARK_SHARE_TEST_BOOTSTRAP")
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), name=f"busy-{i}", daemon=True)
                for i in range(args.busy)]
    for p in spinners:
        p.start()
    started = time.monotonic()
    try:
        rc = subprocess.run([sys.executable, "-m", "pytest", *(args.pytest_args or ["tests/integration"])],
                            cwd=ROOT, env=env).returncode
    finally:
        stop.set()
        for p in spinners:
            p.join(10)
            if p.is_alive():
                p.kill()
    print(f"loaded_run: {args.busy} busy processes beside the run; pytest exit {rc} after "
          f"{(time.monotonic() - started) / 60:.1f} min", flush=True)
    return 1 if rc == 5 else rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
