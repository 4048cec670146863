"""A Spark driver lost with its whole process group (SIGKILL: JVM, the source's runner, Python workers), then
the query started again from its checkpoint and drained, in the default ``readMode=driver``
(``killed_driver_app.py`` is the driver program). Each ends with every record once in an idempotent sink:

- killed after the sink wrote batch 1 and before Spark's commit log: Spark runs batch 1 again, which must
  carry the same records (the sink skips a batch id it has: records of another batch there would be lost,
  and batch 1's own records in a later batch id written twice);
- killed after batch 0's commit log and before its acknowledgement: batch 0's records come back from the
  broker unacknowledged and must be ACCEPTed, never handed to a later batch;
- Spark's file sink, killed after batch 0's commit log, whose entry is then removed: that leaves the
  checkpoint as a kill between the file sink's own commit and Spark's commit log does. Spark (4.3) does
  not run batch 0 again then: its file sink has the batch, and the restart starts from batch 0's end, so
  batch 0's records must be ACCEPTed when they come back, as after a commit.

A toy (acquire in the read task, ACCEPT at its end) fails each: the first two write batch 1's or batch 0's
records twice, the file sink's replay loses what it was handed instead.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from harness.pipelines import read_file_sink
from harness.support import Workload, check_no_loss, drain_share_group, gid, kafka_options
from spark_share.offsets import from_progress, records_of

pytestmark = pytest.mark.slow

APP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "killed_driver_app.py")
RUN_TIMEOUT_S = 420.0


def _run(kafka, conf: dict) -> str:
    """The driver program to its end (a kill, or a drain); its output."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    proc = subprocess.Popen([sys.executable, APP, json.dumps(conf)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(kafka_options(kafka)) + "\n", timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        raise AssertionError(f"the driver program did not end within {RUN_TIMEOUT_S:.0f} s")
    with open(os.path.join(os.path.dirname(conf["out"]), f"driver-{conf['kill']}.log"), "w") as f:
        f.write(err)  # the driver's log (spark-share's lines among Spark's), beside the test's files
    if conf["kill"] == "none":
        assert proc.returncode == 0, f"the restart failed (exit {proc.returncode}):\n{err[-4000:]}"
    else:
        assert f"KILLING {conf['batch']}" in out, f"the program was not killed where asked:\n{out}\n{err[-4000:]}"
    return out


def _tracker_counts(out: str) -> dict:
    """The tracker's counts in the restart's last progress report."""
    line = next(x for x in out.splitlines() if x.startswith("PROGRESS "))
    progress = json.loads(line[len("PROGRESS "):])
    assert progress, "the restart reported no progress"
    latest = progress[-1]["sources"][0]["latestOffset"]
    return from_progress(latest) if isinstance(latest, str) else latest


def _batch_dirs(out: str) -> dict[int, list[int]]:
    written = {}
    for d in glob.glob(os.path.join(out, "batch_id=*")):
        with open(os.path.join(d, "ids.json")) as f:
            written[int(d.rsplit("=", 1)[1])] = json.load(f)
    return written


def _handed(out: str, batch_id: int) -> list[list[int]]:
    """The ids each run handed the sink as batch ``batch_id``, in the order the runs wrote them."""
    found = sorted(glob.glob(os.path.join(out, "_handed", f"{batch_id}-*.json")), key=os.path.getmtime)
    return [json.load(open(f)) for f in found]


def _setup(kafka, tmp_path, sink: str, records: int = 1200, partitions: int = 2):
    # The killed run's members keep their partitions until the group's session timeout, which the restart's
    # replay waits out: 6 s here. The embedded broker does not say its timeout, so the replay waits a record lock
    # (30 s) there; with the mock's own default, a poll just as the lost members went found a partition's later
    # records first once, and the replay lacked that partition's records of the batch.
    kafka.set_session_timeout(6000)
    w = Workload(kafka, "killed", partitions=partitions)
    w.produce(records)
    conf = {"checkpoint": str(tmp_path / "ck"), "out": str(tmp_path / "out"), "sink": sink,
            "group": kafka.group(gid()), "topic": w.topic, "maxRecordsPerTrigger": 300}
    return w, conf


def test_killed_after_the_sink_wrote_a_batch_the_replay_carries_the_same_records(kafka, tmp_path):
    # One partition: each batch is one poll of one consumer. (A batch that was two polls of one partition, which
    # the embedded broker sometimes hands two members at first, comes back partly: docs/guarantees.md.)
    w, conf = _setup(kafka, tmp_path, "batch_dirs", partitions=1)
    _run(kafka, {**conf, "kill": "after_sink_write", "batch": 1})
    assert not os.path.exists(os.path.join(conf["checkpoint"], "commits", "1"))
    out = _run(kafka, {**conf, "kill": "none"})
    first, replay = _handed(conf["out"], 1)
    assert sorted(replay) == sorted(first), (f"batch 1 ran again with other records: {len(set(replay) - set(first))} "
                                             f"new, {len(set(first) - set(replay))} missing")
    written = [i for ids in _batch_dirs(conf["out"]).values() for i in ids]
    report = check_no_loss(w.ids, written)
    assert report.duplicates == 0, report
    counts = _tracker_counts(out)
    assert counts.get("replayMissing", 0) == 0, counts
    assert not drain_share_group(kafka, conf["group"], [w.topic], timeout=5), "records were left in the group"
    print(f"killed after the sink's write of batch 1 ({len(first)} records): the replay carried the same "
          f"{len(replay)}; the sink holds {report.delivered} of {len(w.ids)}, 0 duplicates")


def test_killed_after_the_commit_log_the_committed_records_are_accepted_not_emitted(kafka, tmp_path):
    w, conf = _setup(kafka, tmp_path, "batch_dirs")
    _run(kafka, {**conf, "kill": "after_commit_log", "batch": 0})
    assert os.path.exists(os.path.join(conf["checkpoint"], "commits", "0"))
    out = _run(kafka, {**conf, "kill": "none"})
    written = _batch_dirs(conf["out"])
    report = check_no_loss(w.ids, [i for ids in written.values() for i in ids])
    assert report.duplicates == 0, report
    assert len(_handed(conf["out"], 0)) == 1, "batch 0 was committed: Spark must not run it again"
    counts = _tracker_counts(out)
    assert counts.get("acceptedAgain") == len(written[0]), counts
    assert not drain_share_group(kafka, conf["group"], [w.topic], timeout=5), "records were left in the group"
    print(f"killed after batch 0's commit log: its {len(written[0])} records came back and were ACCEPTed "
          f"unseen ({counts.get('acceptedAgain')}); the sink holds {report.delivered} of {len(w.ids)}, 0 duplicates")


def test_the_file_sink_gets_every_record_once_after_a_driver_killed_before_the_commit_log(kafka, tmp_path):
    w, conf = _setup(kafka, tmp_path, "parquet")
    _run(kafka, {**conf, "kill": "after_commit_log", "batch": 0})
    for name in ("0", ".0.crc"):  # the entry and its checksum: as if the kill came before Spark wrote them
        os.remove(os.path.join(conf["checkpoint"], "commits", name))
    out = _run(kafka, {**conf, "kill": "none"})
    rows = read_file_sink(conf["out"]).select(["value"]).to_pylist()  # the files its metadata log lists
    report = check_no_loss(w.ids, [json.loads(r["value"])["id"] for r in rows])
    assert report.duplicates == 0, report
    counts = _tracker_counts(out)
    batch0 = records_of(json.loads(open(os.path.join(conf["checkpoint"], "offsets", "0")).read().splitlines()[-1]))
    assert counts.get("acceptedAgain") == len(batch0), counts
    print(f"file sink, killed before batch 0's commit log: {report.delivered} of {len(w.ids)}, 0 duplicates; "
          f"acceptedAgain {counts.get('acceptedAgain', 0)}")
