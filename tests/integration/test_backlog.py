"""The backlog estimate a user can alert on (spark_share/backlog.py): in the progress JSON, in status(),
in the tracker's log and in `spark-share status`; it grows while the query is behind and goes to 0
once it has drained. On both brokers."""
from __future__ import annotations

import os
import subprocess
import sys

import spark_share
from harness.support import BatchCollector, Workload, gid, read_stream, source_progress, tracker_log, wait_until


def _status(q) -> dict:
    """status(), or {} before the tracker has registered the query (its first batch's reads)."""
    try:
        return spark_share.status(q)
    except spark_share.VerdictError:
        return {}


def test_the_backlog_estimate_grows_while_behind_and_is_zero_once_drained(spark, kafka, tmp_path):
    w = Workload(kafka, "lag", partitions=2)
    w.produce(3000)
    collector = BatchCollector()
    q = (read_stream(spark, kafka, kafka.group(gid()), w.topic, maxRecordsPerTrigger=100).writeStream
         .foreachBatch(collector).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="1 second").start())
    try:
        behind = wait_until(lambda: (_status(q).get("backlogEstimate") or 0) if q.isActive else -1,
                            timeout=90, message="no backlog estimate while the query was behind")
        assert behind > 0, q.exception()
        cli = subprocess.run([sys.executable, "-m", "spark_share.cli", "status"], capture_output=True, text=True,
                             timeout=60, env=dict(os.environ))
        assert cli.returncode == 0 and f"query {q.id}" in cli.stdout and "backlog estimate" in cli.stdout, cli
        wait_until(lambda: collector.has_all(w.ids) or not q.isActive, timeout=180,
                   message="the query did not drain the backlog")
        status = wait_until(lambda: (lambda s: s if s.get("backlogEstimate") == 0 else None)(_status(q)),
                            timeout=30, message="the backlog estimate did not go to 0 after the drain")
        parts = status["backlog"]
        assert sum(v["backlog"] for v in parts.values()) == 0
        assert sum(v["highWatermark"] for v in parts.values()) == 3000
        assert all(v["maxAcquired"] == v["highWatermark"] - 1 for v in parts.values()), parts
    finally:
        q.stop()
    assert "backlogEstimate" in source_progress(q), "the progress JSON carries the estimate"
    assert "backlog estimate" in tracker_log(q), "the tracker logs the estimate"
    print(f"backlog estimate: {behind} while behind (100 records a batch of 3,000: 30 s behind, the estimate refreshed every 10 s), 0 after the drain; "
          f"`spark-share status`: {cli.stdout.strip()[:300]}")
