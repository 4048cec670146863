"""Random, overlapping faults on a continuous query (tests/harness/chaos.py, seeded): nothing lost, every
duplicate and every query failure after a fault, the group empty at the end, and no resource of the
query's processes growing after warm-up. Three minutes on the embedded broker (with its error
injection), and on a real broker of the kit (restarted and killed). SPARK_SHARE_CHAOS_SEED replays
another schedule; the run's report, samples and plot are kept in the test's tmp_path."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.embedded_only("injects broker errors (ShareFetch, ShareAcknowledge) and takes the broker down")
def test_three_minutes_of_overlapping_faults_lose_nothing_and_grow_nothing(tmp_path):
    seed = os.environ.get("SPARK_SHARE_CHAOS_SEED", "1")
    out = tmp_path / "chaos"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "harness", "chaos.py"), "--minutes", "3", "--seed", seed, "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    print(run.stdout)
    assert run.returncode == 0, (f"chaos run failed (replay: {' '.join(cmd[1:])}):\n{run.stdout[-6000:]}\n"
                                 f"{run.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    injected = [f for f in report["faults"] if f["started"] is not None and not f["outcome"].startswith("not ")]
    assert len({f["kind"] for f in injected}) >= 8, f"too few kinds of fault were injected: {injected}"
    assert report["produced"] >= 15_000 and report["lost"] == 0 and report["left_in_group"] == 0
    assert report["written"] + report["rejected"] >= report["produced"]
    assert report["poison_written"] == 0 and report["rejected"] >= report["poison_produced"]
    assert report["query_runs"] >= 3, "the query was never restarted: the faults did not reach it"
    assert not [v for v in report["growth"] if v["grows"]]
    assert (out / "resources.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.real_only("restarts and kills the real broker it starts")
def test_overlapping_faults_with_broker_restarts_and_kills_on_a_real_broker_lose_nothing(broker_choice, tmp_path):
    if broker_choice.start_script is None:
        pytest.skip("starts its own broker: needs SPARK_SHARE_TEST_KAFKA_START")
    seed = os.environ.get("SPARK_SHARE_CHAOS_SEED", "1")
    out = tmp_path / "chaos"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "harness", "chaos.py"), "--minutes", "3", "--seed", seed, "--out", str(out),
           "--kafka-start", broker_choice.start_script]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    print(run.stdout)
    assert run.returncode == 0, (f"chaos run failed (replay: {' '.join(cmd[1:])}):\n{run.stdout[-6000:]}\n"
                                 f"{run.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    injected = {f["kind"] for f in report["faults"] if f["started"] is not None and not f["outcome"].startswith("not ")}
    assert {"broker_restart", "broker_kill"} <= injected and len(injected) >= 6, f"too few kinds of fault: {injected}"
    assert report["produced"] >= 15_000 and report["lost"] == 0 and report["left_in_group"] == 0
    assert report["written"] + report["rejected"] >= report["produced"]
    assert report["poison_written"] == 0 and report["rejected"] >= report["poison_produced"]
    assert not [v for v in report["growth"] if v["grows"]]
