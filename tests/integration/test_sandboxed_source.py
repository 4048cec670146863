"""The source's process sandboxed apart from the user's code on the driver (point 2 of issue 49): a classic
application whose Python workers (the source's runner, the read tasks, the agents) each get a mount
namespace with an empty /tmp, while foreachBatch runs in the application's own process. They share no
runtime directory, so the registry under /tmp cannot bring verdicts to the tracker; the source option
``exchangeLocation``, a directory both see (bound into the sandboxes, as a Unity Catalog volume is), does.
foreachBatch learns it from the batch's schema (Spark >= 4.2; here in driver mode) or names it itself, with
the rows collected to a list (executors mode here, and both modes on Spark < 4.2, whose batches cannot carry
it).
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

import pytest

from harness.spark_hosts import private_tmp_command
from harness.support import Workload, check_tens_rejected, gid
from spark_share import spark_versions

pytestmark = pytest.mark.slow

APP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandboxed_source_app.py")


@pytest.mark.both_read_modes
def test_verdicts_reach_a_source_sandboxed_apart_from_foreach_batch_through_its_exchange_location(
        kafka, read_mode, tmp_path):
    """Without ``exchangeLocation``, reject() fails the query naming the option, and the batch's records come
    back; with it, every record is read once more and once only, the rejected ones dead-lettered, 0 lost,
    nothing left queued, and the tracker left nothing in the application's runtime directory or in the
    exchange location."""
    exchange_in = "schema" if spark_versions.SCHEMA_METADATA and read_mode == "driver" else "argument"
    w = Workload(kafka, "sandboxed-source", partitions=2)
    ids = w.produce(300)
    group = kafka.group(gid())
    shared = tmp_path / "shared"  # what both sides see: the exchange location and the dead-letter table
    (shared / "exchange").mkdir(parents=True)
    stage = tempfile.mkdtemp(prefix="sandboxed-source-stage-", dir="/var/tmp")
    local_dir = tempfile.mkdtemp(prefix="sandboxed-source-local-", dir="/var/tmp")
    try:
        sandboxed = private_tmp_command([sys.executable], stage, str(shared))
        if sandboxed is None:
            pytest.skip("a mount namespace per Python worker needs root and unshare")
        wrapper = tmp_path / "python-in-a-sandbox"
        # None of the application's environment of ours reaches a sandbox (restriction (f)).
        wrapper.write_text("#!/bin/sh\nexec env -u SPARK_SHARE_RUNTIME_DIR "
                           + " ".join(shlex.quote(a) for a in sandboxed) + ' "$@"\n')
        wrapper.chmod(0o755)
        runtime_dir = tmp_path / "app-runtime"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_SHARE_")}
        env["SPARK_SHARE_RUNTIME_DIR"] = str(runtime_dir)  # the app's; a sandbox sees an empty /tmp there
        env["PYSPARK_PYTHON"] = str(wrapper)  # every Python process Spark starts (sc.pythonExec)
        run = subprocess.run([sys.executable, APP, "--local-dir", local_dir,
                              "--bootstrap", kafka.bootstrap_servers, "--topic", w.topic, "--group",
                              group, "--read-mode", read_mode, "--exchange", str(shared / "exchange"),
                              "--exchange-in", exchange_in,
                              "--out", str(shared / "out"), "--checkpoint", str(tmp_path / "ck")],
                             env=env, capture_output=True, text=True, timeout=600)
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)
        os.rmdir(stage)  # the sandboxes' mounts on it ended with them
    line = next((x for x in run.stdout.splitlines() if x.startswith("APP ")), None)
    assert run.returncode == 0 and line, f"the app failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    seen = json.loads(line[len("APP "):])
    assert seen["runnerNamespaces"] and seen["mountNamespace"] not in seen["runnerNamespaces"], \
        f"the source's runner shared the application's mounts: {seen}"
    # Without it: the refusal names the option, instead of a hang or a silent loss.
    assert seen["withoutEnded"] and "exchangeLocation" in (seen["withoutException"] or ""), seen
    # With it:
    assert seen["ended"] and seen["exception"] is None, seen
    check_tens_rejected(kafka, group, w.topic, ids, str(shared / "out"), seen)
    assert os.listdir(shared / "exchange") == [], "the tracker left its mailbox behind"
    ours = [n for n in (os.listdir(runtime_dir) if runtime_dir.exists() else []) if n.startswith(("run-", "query-"))]
    assert ours == [], f"the sandboxed tracker registered in the application's runtime directory: {ours}"
