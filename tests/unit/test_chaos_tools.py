"""The chaos run's own judges (tests/harness/chaos.py, tests/harness/resources.py): a leak fails the growth verdict
while steps and noise do not; a duplicate with no fault before it is unexplained; the schedule is
the seed's alone."""
from __future__ import annotations

import random

import pytest

from harness.chaos import FAULTS, Fault, explain_duplicates, schedule
from harness.resources import KINDS, growth_verdict, theil_sen


def samples(rss_of_t, n=60, every=5.0):
    out = []
    for i in range(n):
        t = i * every
        kinds = {k: {"n": 1, "rss_mib": 100.0, "fds": 20, "threads": 10, "sockets": 5} for k in KINDS}
        kinds["agent"]["rss_mib"] = rss_of_t(t)
        out.append({"t": t, "kinds": kinds, "runtime_files": 5, "runtime_bytes": 300, "log_bytes": 1000 + 50 * i,
                    "checkpoint_files": 80})
    return out


def grows(s, warmup=30.0):
    return {v.name for v in growth_verdict(s, warmup) if v.grows}


def test_a_leak_fails_the_verdict():
    assert grows(samples(lambda t: 100 + 0.5 * t)) == {"agent rss_mib"}  # 0.5 MiB/s


def test_noise_one_step_and_a_restart_do_not():
    rnd = random.Random(3)
    assert grows(samples(lambda t: 100 + rnd.uniform(-20, 20))) == set()
    assert grows(samples(lambda t: 100 if t < 150 else 130)) == set(), "one step up (a session started)"
    assert grows(samples(lambda t: 150 if 100 < t < 110 else 100)) == set(), "a spike"
    assert grows(samples(lambda t: 100 + (t % 100) * 0.2)) == set(), "a sawtooth: a process killed and restarted"


def test_a_process_absent_between_query_runs_is_no_growth_from_zero():
    # The runner and the agent are gone while the query restarts: 0 MiB then, 100 MiB once it runs again.
    s = samples(lambda t: 100)
    for x in s:
        if x["t"] < 60:
            x["kinds"]["agent"] = {"n": 0, "rss_mib": 0.0, "fds": 0, "threads": 0, "sockets": 0}
    assert grows(s) == set()
    # A process that is there and leaks still fails the verdict, gaps or not.
    leaking = samples(lambda t: 100 + 0.5 * t)
    for x in leaking[10:14]:
        x["kinds"]["agent"] = {"n": 0, "rss_mib": 0.0, "fds": 0, "threads": 0, "sockets": 0}
    assert grows(leaking) == {"agent rss_mib"}


def test_too_few_samples_after_warm_up_is_an_error():
    with pytest.raises(ValueError, match="too few"):
        growth_verdict(samples(lambda t: 100, n=8), warmup_s=30)


def test_theil_sen_ignores_an_outlier():
    assert theil_sen([0, 1, 2, 3, 4], [0, 1, 100, 3, 4]) == pytest.approx(1.0)


def test_the_schedule_is_the_seeds_and_deals_every_kind():
    a, b = schedule(7, 600, 12), schedule(7, 600, 12)
    assert [(f.at, f.kind, f.duration, f.errors) for f in a] == [(f.at, f.kind, f.duration, f.errors) for f in b]
    assert [f.at for f in schedule(8, 600, 12)] != [f.at for f in a]
    assert {f.kind for f in a[:len(FAULTS)]} == set(FAULTS)
    assert all(0 < f.at < 600 for f in a)


def test_a_duplicate_needs_a_fault_before_it():
    fault = Fault(at=10, kind="kill_agent", started=1000.0, ended=1000.0, outcome="killed agent")
    near = {1: [(1005.0, 1006.0, "batch 3"), (1012.0, 1013.0, "batch 4")]}
    far = {2: [(1100.0, 1101.0, "batch 30"), (1102.0, 1103.0, "batch 31")]}
    before = {3: [(990.0, 991.0, "batch 1"), (999.0, 999.5, "batch 2")]}  # repeated before the fault
    combos, unexplained = explain_duplicates({**near, **far, **before}, [fault], lock_s=6.0)
    assert dict(combos) == {"kill_agent": 1} and sorted(unexplained) == [2, 3]
    skipped = Fault(at=10, kind="kill_agent", started=1000.0, ended=1000.0, outcome="no agent process to kill")
    assert explain_duplicates(near, [skipped], lock_s=6.0)[1] == [1], "a fault that did nothing explains nothing"


def test_what_spark_keeps_per_query_run_is_judged_apart():
    s = samples(lambda t: 100)
    for i, x in enumerate(s):  # a query run every 10 s, each leaving py4j a connection and its thread
        x["kinds"]["driver"]["threads"] += i // 2
        x["kinds"]["driver"]["sockets"] += i // 2
    assert grows(s) == {"driver threads", "driver sockets"}, "growth with no query runs to explain it fails"
    for i, x in enumerate(s):
        x["query_runs"] = 1 + i // 2
    assert grows(s) == set()
    for i, x in enumerate(s):
        x["kinds"]["driver"]["threads"] += i  # twice as fast as the runs: a leak of its own
    assert grows(s) == {"driver threads"}


def test_spark_bounded_pool_threads_are_counted_apart():
    """Threads named as Spark's capped block-manager pools are not JVM threads the verdict judges."""
    import subprocess
    import sys

    from harness.resources import _bounded_pool_threads

    helper = subprocess.Popen([sys.executable, "-c", """
import sys, threading
named = threading.Barrier(7)  # six named threads and this one
def run(name):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(name)
    named.wait()
    sys.stdin.read()
for i in range(5):
    threading.Thread(target=run, args=("block-manager-ask-" if i % 2 else "block-manager-storage",), daemon=True).start()
threading.Thread(target=run, args=("Executor task",), daemon=True).start()
named.wait()
print("ready", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline().strip() == "ready"
        assert _bounded_pool_threads(helper.pid) == 5
    finally:
        helper.stdin.close()
        helper.wait(10)
