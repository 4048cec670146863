"""The core of the integration suite on the other supported Sparks: PySpark 4.0, 4.1 and 4.2 beside
./dev's 4.3 (tests/runtimes.json, "ci"), each in a venv of its own installed as a user's runtime is.

For each entry: a venv on the Python its platform ships, the runtime first (its PySpark with the Connect
client, and the pyarrow, pandas, numpy and cryptography it ships), then the spark-share wheel the way a
user installs it (``pip install spark_share-*.whl``), then a check that pip left the runtime's packages
as they were (the wheel must not replace a runtime's PySpark), then the test tools, then the core tests
on the embedded broker (``CORE`` below, ``ON_THE_OLDEST`` on the first entry; docs/testing.md says why
these). The tests import the installed wheel: pytest runs from tests/, so the repository's own
spark_share/ is not on the path.

    .venv/bin/python tests/harness/spark_matrix.py                 # every entry
    .venv/bin/python tests/harness/spark_matrix.py --only 4.0.5 -- -k drain   # one, and pytest arguments
    .venv/bin/python tests/harness/spark_matrix.py --prepare      # only the venvs (./dev test, beside its first pass)

Venvs are kept under .venv-spark/<pyspark>/ and reused while the entry and the wheel's dependencies
are unchanged. Exit code: 0 if every entry passed, else 1 (pytest's "no tests" counts as a failure,
unless pytest arguments were given: ``./dev test -k x`` may select nothing of the core).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNTIMES = os.path.join(ROOT, "tests", "runtimes.json")
VENVS = os.path.join(ROOT, ".venv-spark")
TEST_TOOLS = ["pytest>=8", "psutil>=5.9", "chispa>=0.10", "nbclient>=0.10", "nbformat>=5", "ipykernel>=6",
              "pyyaml>=6"]  # pyyaml: the spark-pipelines command (pyspark[pipelines]) and the pipeline tests
# The core, on every entry: what differs between Sparks (and the version check), the source
# (AvailableNow, drains, idle, restarts), the fault rows whose path runs through Spark's calls (a crash
# after the sink's write, replays, zombie reads), the scheduled job end to end, the example pipeline run
# again after a kill, and Spark Connect.
JOB_RUNS = ["integration/test_job.py::test_job_end_to_end_on_the_embedded_broker",
            # The example declarative pipeline, an update killed and run again (Spark >= 4.1; the module
            # skips itself before): its four updates in a row, 2.7 minutes, ran here by hand (docs/deploy.md).
            # (its definitions call spark_share.register(spark): the rerun and one more update exit 0)
            "integration/test_pipelines.py::test_an_update_killed_mid_flow_loses_nothing_when_run_again"]
CORE = [
    "unit/test_version_check.py",
    "integration/test_spark_versions.py",
    "integration/test_source.py",
    "integration/faults/test_crash_before_commit.py",
    "integration/faults/test_replays_and_zombie_reads.py",
    *JOB_RUNS,
    "integration/test_connect.py",
]
# On the oldest entry (4.0, the one furthest from 4.3) also what runs in our own code the same way on
# every Spark once the reader runs: verdicts and dead letters (and verdicts on batch ids that run ahead),
# the fault rows the embedded broker injects (ShareFetch and ShareAcknowledge errors, the broker down, a
# dead-letter topic that refuses writes), and the rest of the job's tests (its demo, configs, the
# notebook). The fault rows that kill or stop our own processes (agent, runner and worker kills, stop
# mid-batch, task retries, a short lock) run on 4.3 only, both brokers.
# Tests of the core files above that run only our own code (option checks, our sockets, secrets in our
# texts): on the oldest entry, not again on the others.
OURS_IN_THE_CORE = ["integration/test_source.py::test_bad_setup_fails_fast_with_a_clear_error",
                    "integration/test_source.py::test_sockets_refuse_peers_without_the_secret",
                    "integration/test_source.py::test_secrets_never_leak"]
# Spark 4.2 makes every call of a Python source as 4.3 does (spark_share/spark_versions.py has no gate between
# them): it runs what differs in Spark itself (versions, replays, the job), and leaves test_source.py, the
# crash after the write, the pipeline (run by hand on 4.2.1: docs/deploy.md) and Spark Connect to 4.3.
AS_ON_4_3 = ("4.2.",)
LEFT_TO_4_3 = ["integration/test_source.py", "integration/faults/test_crash_before_commit.py",
               "integration/test_connect.py", JOB_RUNS[1]]
# Spark Connect without source progress (4.0 and 4.1 alike): on the oldest entry. 4.0 and 4.1 make the same
# calls of a Python source (spark_share/spark_versions.py gates only pipelines between them): the source's own
# tests run on the oldest entry too, and 4.1 runs what its pipelines and replays change.
CONNECT = "integration/test_connect.py"
SAME_AS_THE_OLDEST = [CONNECT, "integration/test_source.py"]
# readMode=driver names a batch's records in its offset; Spark < 4.2 brings them back on a restart through
# calls of its own (partitions(end, end) for a batch it runs again): the replay rows in that mode too, on
# 4.1 (4.0 makes the same calls, docs/architecture.md "Spark versions").
DRIVER_REPLAYS = {"4.1.": ["integration/faults/test_replays_and_zombie_reads.py",
                           "integration/faults/test_crash_before_commit.py"]}
ON_THE_OLDEST = [t for t in CORE if t not in JOB_RUNS] + [
    "integration/test_verdicts.py",
    "integration/faults/test_user_verdicts.py",
    "integration/faults/test_broker_faults.py",
    "integration/faults/test_dead_letter_failures.py",
    "integration/test_job.py::test_job_end_to_end_on_the_embedded_broker",
    # exchangeLocation reaches reject() in the batch's schema metadata, which Spark keeps for a Python source
    "integration/test_sandboxed_source.py",
]


def find_python(minor: str) -> str:
    """An interpreter of Python ``minor`` (3.12): on PATH, else pyenv's."""
    candidates = [shutil.which(f"python{minor}") or ""]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{minor}.*", "bin", f"python{minor}")),
                         reverse=True)
    for py in candidates:
        if py and subprocess.run([py, "-c", "import venv"], capture_output=True).returncode == 0:
            return py
    raise SystemExit(f"spark_matrix: no Python {minor} found (python{minor} on PATH or under pyenv); "
                     f"install it, e.g. pyenv install {minor}")


def pip(venv: str, *args: str) -> None:
    subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", *args], check=True)


def versions(venv: str, names: list[str]) -> dict[str, str | None]:
    code = ("import importlib.metadata as m, json, sys\n"
            "out = {}\n"
            "for n in sys.argv[1:]:\n"
            "    try: out[n] = m.version(n)\n"
            "    except m.PackageNotFoundError: out[n] = None\n"
            "print(json.dumps(out))")
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", code, *names], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def build_wheel() -> str:
    out = os.path.join(ROOT, "build", "wheel")
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                    "-w", out, ROOT], check=True)
    return glob.glob(os.path.join(out, "spark_share-*.whl"))[0]


def prepare(entry: dict, wheel: str) -> str:
    """The entry's venv: the runtime, then the wheel as a user installs it; fails if pip changed the
    runtime's packages."""
    venv = os.path.join(VENVS, entry["pyspark"])
    runtime = [f"pyspark[connect]=={entry['pyspark']}", *(f"{k}=={v}" for k, v in entry["libraries"].items())]
    stamp_text = json.dumps([entry, TEST_TOOLS, hashlib.sha256(open(os.path.join(ROOT, "pyproject.toml"), "rb")
                                                                 .read()).hexdigest()])
    stamp = os.path.join(venv, ".spark-matrix")
    fresh = not (os.path.exists(stamp) and open(stamp).read() == stamp_text)
    if fresh:
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([find_python(entry["python"]), "-m", "venv", venv], check=True)
        pip(venv, *runtime)
    watched = ["pyspark", *entry["libraries"]]
    before = versions(venv, watched)
    pip(venv, "--force-reinstall", "--no-deps", wheel)  # this tree's code, always
    if fresh:
        pip(venv, wheel)  # its dependencies, as a user's `pip install spark-share` resolves them
    after = versions(venv, watched)
    if after != before:
        raise SystemExit(f"spark_matrix: installing the wheel changed the runtime's packages: {before} -> {after}")
    if fresh:
        pip(venv, *TEST_TOOLS)
        with open(stamp, "w") as f:
            f.write(stamp_text)
    return venv


def tests_of(entry: dict, oldest: bool) -> list[str]:
    """The entry's pytest arguments: test files, and the tests of them it leaves out."""
    tests = ON_THE_OLDEST if oldest else CORE
    if entry["pyspark"].startswith(AS_ON_4_3):
        tests = [t for t in tests if t not in LEFT_TO_4_3]
    elif not oldest:
        tests = [t for t in tests if t not in SAME_AS_THE_OLDEST]
    # Node ids are relative to the rootdir (the repository), not to tests/ where pytest runs.
    return tests + ([] if oldest else [a for t in OURS_IN_THE_CORE for a in ("--deselect", f"tests/{t}")])


def run(entry: dict, wheel: str, pytest_args: list[str], oldest: bool) -> tuple[int, float]:
    started = time.monotonic()
    venv = prepare(entry, wheel)
    py = versions(venv, ["pyspark", "pyarrow", "pandas", "numpy"])
    print(f"spark_matrix: PySpark {entry['pyspark']} ({entry['as']}), "
          f"{subprocess.run([os.path.join(venv, 'bin', 'python'), '--version'], capture_output=True, text=True).stdout.strip()}, "
          f"{', '.join(f'{k} {v}' for k, v in py.items())}", flush=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPARK_SHARE_TEST_BOOTSTRAP", "SPARK_SHARE_TEST_KAFKA_START", "SPARK_SHARE_TEST_REAL_PASS",
                        "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
    runs = [("executors", tests_of(entry, oldest))]  # the modes differ in how rows reach the tasks
    runs += [("driver", t) for prefix, t in DRIVER_REPLAYS.items() if entry["pyspark"].startswith(prefix)]
    rc = 0
    for modes, tests in runs:
        env["SPARK_SHARE_TEST_READ_MODES"] = modes
        # From tests/: `python -m` (the agent, Spark's runner) must not find the repository's spark_share/.
        one = subprocess.run([os.path.join(venv, "bin", "pytest"), "-c", os.path.join(ROOT, "pyproject.toml"),
                              "--rootdir", ROOT, "-p", "no:cacheprovider", *tests, *pytest_args],
                             cwd=os.path.join(ROOT, "tests"), env=env).returncode
        if one == 5:  # no tests: a failure, unless pytest arguments (-k ...) selected none of the core
            print(f"spark_matrix: PySpark {entry['pyspark']} (readMode {modes}): pytest selected no tests", flush=True)
            one = 0 if pytest_args else 1
        rc = rc or one
    return rc, time.monotonic() - started


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", help="a PySpark version of tests/runtimes.json's 'ci' (repeatable)")
    ap.add_argument("--prepare", action="store_true",
                    help="only set up each entry's venv, run nothing (./dev test does it beside the embedded pass)")
    ap.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = ap.parse_args(argv)
    ci = json.load(open(RUNTIMES))["ci"]
    entries = [e for e in ci if not args.only or e["pyspark"] in args.only]
    if not entries:
        raise SystemExit(f"spark_matrix: no entry of {RUNTIMES} matches {args.only}")
    wheel = build_wheel()
    if args.prepare:
        for e in entries:
            started = time.monotonic()
            prepare(e, wheel)
            print(f"spark_matrix: PySpark {e['pyspark']}: venv ready in {time.monotonic() - started:.0f} s", flush=True)
        return 0
    results = [(e, *run(e, wheel, args.pytest_args, oldest=e is ci[0])) for e in entries]
    for e, rc, took in results:
        print(f"spark_matrix: PySpark {e['pyspark']}: {'passed' if rc == 0 else f'FAILED ({rc})'} "
              f"in {took / 60:.1f} min")
    return 0 if all(rc == 0 for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
