"""The job's summary (spark-share demo, jobs/queue_to_table.py): the reading time, from the query's progress
reports, and the wall time, each with its records/s and labelled; without Spark."""
from __future__ import annotations

import re
from collections import Counter
from types import SimpleNamespace

import pytest

from spark_share.job import pipeline


def _report(batch: int, stamp: str, rows: int, took_ms: int) -> dict:
    """A progress report as PySpark gives it (a dict; StreamingQueryProgress subclasses dict)."""
    return {"batchId": batch, "timestamp": stamp, "numInputRows": rows, "batchDuration": took_ms,
            "durationMs": {"triggerExecution": took_ms}}


def test_reading_runs_from_the_first_batch_with_records_to_the_end_of_the_last():
    batches = pipeline._Batches()
    reports = [
        _report(0, "2026-12-06T10:00:00.000Z", 0, 800),       # the first trigger found nothing yet
        _report(1, "2026-12-06T10:00:01.000Z", 5000, 2000),   # reading starts here
        _report(1, "2026-12-06T10:00:01.000Z", 5000, 2000),   # the same report, polled again
        _report(2, "2026-12-06T10:00:03.500Z", 4000, 1500),
        _report(3, "2026-12-06T10:00:05.000Z", 0, 100),       # a report without data: the id of the batch to come
        _report(3, "2026-12-06T10:00:06.000Z", 1000, 1250),   # ... which then reads: reading ends at 07.250
        _report(4, "2026-12-06T10:00:08.000Z", 0, 300),       # the empty batch that ends a drain
    ]
    new = [batches.note(r) for r in reports]
    assert new == [0, 1, None, 2, 3, 3, 4]
    assert batches.rows == {0: 0, 1: 5000, 2: 4000, 3: 1000, 4: 0}
    assert batches.reading() == pytest.approx(6.25)


def test_no_batch_with_records_has_no_reading_time():
    batches = pipeline._Batches()
    batches.note(_report(0, "2026-12-06T10:00:00.000Z", 0, 500))
    assert batches.reading() is None


def _summary_text(monkeypatch, capsys, summary) -> str:
    monkeypatch.setattr(pipeline, "_read_table", lambda spark, path: None)
    cfg = SimpleNamespace(output_path="/tmp/out", dead_letter_path="/tmp/dead", partition_by="event_date")
    pipeline.print_summary(None, cfg, summary, produced=20000)
    return capsys.readouterr().out


def test_the_summary_shows_the_reading_rate_beside_the_wall_time(monkeypatch, capsys):
    s = pipeline.Summary(records=20375, written=19416, rejected=Counter({"unparseable JSON": 584}), released=375,
                         batches=12, wall=20.0, reading=12.5)
    text = _summary_text(monkeypatch, capsys, s)
    reading = re.search(r"^  reading +([\d.]+) s +\(([\d,]+) records/s, from the first batch's start to the last "
                        r"batch's end\)$", text, re.M)
    wall = re.search(r"^  wall time +([\d.]+) s +\(([\d,]+) records/s, the query's start-up and stop included\)$",
                     text, re.M)
    assert reading and wall, text
    assert (reading[1], reading[2]) == ("12.5", "1,630")
    assert (wall[1], wall[2]) == ("20.0", "1,019")
    # The counts keep their lines (tests and users read them by label).
    assert re.search(r"^  records read +20,375 ", text, re.M) and re.search(r"^  written +19,416$", text, re.M)


def test_a_run_that_read_nothing_shows_the_wall_time_only(monkeypatch, capsys):
    text = _summary_text(monkeypatch, capsys, pipeline.Summary(wall=3.0))
    assert "  reading" not in text and re.search(r"^  wall time +3\.0 s", text, re.M)
