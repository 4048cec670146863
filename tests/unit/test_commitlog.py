"""``spark_share.driver.commitlog``: whether Spark committed a batch id, read from a checkpoint's
``commits`` directory.

Covers where the commit log of a checkpoint root is (a local path, a ``file:`` URI in its forms, a
remote store this process cannot read), the answers for committed and uncommitted batch ids, finding
a query's checkpoint from the note its start left in the runtime directory, and the rule the module
promises: a commit log it cannot read (no note, a broken note, a remote store) answers "not committed",
so the batch is released and delivered again rather than ACCEPTed on a guess.
"""
from __future__ import annotations

import json

import pytest

from spark_share import runtime
from spark_share.driver.commitlog import CommitLog, local_commit_dir


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    d = tmp_path / "runtime"
    monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(d))
    return d


def checkpoint(tmp_path, committed: list[int]):
    """A checkpoint as Spark leaves it: commits/<id> files (and their .crc checksums), offsets/ too."""
    root = tmp_path / "ck"
    (root / "commits").mkdir(parents=True)
    (root / "offsets").mkdir()
    for i in committed:
        (root / "commits" / str(i)).write_text('v1\n{"nextBatchWatermarkMs":0}')
        (root / "commits" / f".{i}.crc").write_bytes(b"crc")
    for i in range(max(committed, default=-1) + 2):  # offsets run one batch ahead of the commits
        (root / "offsets" / str(i)).write_text("v1")
    return root


@pytest.mark.parametrize("given, expected", [
    ("/data/ck", "/data/ck/commits"),
    ("file:/data/ck", "/data/ck/commits"),
    ("file:///data/ck", "/data/ck/commits"),
    ("file://data/ck", "/data/ck/commits"),
    ("relative/ck", "relative/ck/commits"),
])
def test_local_checkpoints_are_read_here(given, expected):
    assert local_commit_dir(given) == expected


@pytest.mark.parametrize("remote", ["s3a://bucket/ck", "abfss://c@acct.dfs.core.windows.net/ck", "dbfs:/ck",
                                    "hdfs://nn:8020/ck", "gs://b/ck"])
def test_remote_checkpoints_are_not_readable_here(remote):
    assert local_commit_dir(remote) is None


def test_committed_batches_are_the_commit_files(tmp_path):
    log = CommitLog(local_commit_dir(str(checkpoint(tmp_path, [0, 1, 2]))))
    assert [log.has(i) for i in range(4)] == [True, True, True, False]  # 3 is planned (offsets/3), not committed


def test_a_file_uri_checkpoint_is_read_like_a_path(tmp_path):
    root = checkpoint(tmp_path, [0])
    assert CommitLog(local_commit_dir(f"file://{root}")).has(0)
    assert CommitLog(local_commit_dir(f"file:{root}")).has(0)


def test_what_cannot_be_read_answers_not_committed(tmp_path):
    assert not CommitLog(None).has(0)  # a remote store
    assert not CommitLog(str(tmp_path / "no-such-checkpoint" / "commits")).has(0)
    assert not CommitLog(local_commit_dir(str(checkpoint(tmp_path, [0])))).has(None)  # no Spark batch id known


def test_a_query_is_found_from_the_note_its_start_left(tmp_path, runtime_dir):
    root = checkpoint(tmp_path, [0, 1])
    runtime.write_private_json(runtime.checkpoint_note_path("q1"), {"root": f"file://{root}"})
    log = CommitLog.of_query("q1")
    assert log is not None and log.directory == str(root / "commits")
    assert log.has(1) and not log.has(2)


def test_no_note_yet_is_no_commit_log(runtime_dir):
    assert CommitLog.of_query("never-started") is None


@pytest.mark.parametrize("note", ['{"path": "/x"}', "not json", "[1, 2]"])
def test_a_note_without_a_root_is_no_commit_log(runtime_dir, note):
    runtime.runtime_dir()
    with open(runtime.checkpoint_note_path("q2"), "w") as f:
        f.write(note)
    assert CommitLog.of_query("q2") is None


def test_a_remote_checkpoint_answers_not_committed_and_says_so(runtime_dir, caplog):
    runtime.write_private_json(runtime.checkpoint_note_path("q3"), {"root": "s3a://bucket/ck"})
    with caplog.at_level("INFO", logger="spark_share.driver.tracker"):
        log = CommitLog.of_query("q3")
    assert log is not None and log.directory is None
    assert not log.has(0)
    assert "not readable here (s3a://bucket/ck)" in caplog.text


def test_the_note_is_json_the_user_process_writes(runtime_dir, tmp_path):
    # spark_share.user.listener writes {"root": ..., "runId": ...}.
    root = checkpoint(tmp_path, [5])
    runtime.write_private_json(runtime.checkpoint_note_path("q4"), {"root": str(root), "runId": "r-1"})
    assert CommitLog.of_query("q4").has(5)


def test_a_run_finds_its_query_and_batches_by_the_offsets_it_wrote(runtime_dir, tmp_path):
    """readMode=driver: no read task names the query to the tracker, so a stop finds the query whose newest
    offsets carry the run's own, and Spark's id of each of its batches there."""
    root = checkpoint(tmp_path, [3])
    for spark_batch, ours in ((2, 0), (3, 1), (4, 2)):  # Spark's ids run ahead of ours (a no-data batch)
        (root / "offsets" / str(spark_batch)).write_text(
            'v1\n{"batchWatermarkMs":0}\n' + json.dumps({"v": 1, "batch": ours, "run": "r1"}))
    runtime.write_private_json(runtime.checkpoint_note_path("other"), {"root": str(tmp_path / "nothing")})
    runtime.write_private_json(runtime.checkpoint_note_path("q9"), {"root": str(root)})
    query, log = CommitLog.of_run("r1")
    assert query == "q9"
    assert log.spark_batch_of("r1", 1) == 3 and log.has(3)
    assert log.spark_batch_of("r1", 2) == 4 and not log.has(4)
    assert log.spark_batch_of("r2", 1) is None and CommitLog.of_run("r2") is None
