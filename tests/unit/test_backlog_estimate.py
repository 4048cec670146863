"""The backlog estimate (spark_share.driver.backlog) from watermarks, acquired offsets and batches in flight."""
from __future__ import annotations

from spark_share.driver import backlog


def test_the_backlog_is_what_lies_beyond_the_highest_acquired_offset_below_the_high_watermark():
    high = {("t", 0): 100, ("t", 1): 50, ("t", 2): 10}
    seen = {("t", 0): 59, ("t", 1): 49}  # partition 2 not read yet by this run
    held = backlog.in_flight([{"offsets": {"t": {"0": [[40, 49], [55, 59]]}}}, {"offsets": {"t": {"1": [[49, 49]]}}}])
    assert held == {("t", 0): 15, ("t", 1): 1}
    view = backlog.estimate(high, seen, held)
    assert view["kind"] == "estimate" and view["backlogEstimate"] == 40
    assert view["partitions"]["t-0"] == {"highWatermark": 100, "maxAcquired": 59, "inFlight": 15, "backlog": 40}
    assert view["partitions"]["t-1"]["backlog"] == 0, "read up to the high watermark: no backlog"
    assert view["partitions"]["t-2"]["backlog"] is None, "where the group starts in an unread partition is the broker's"
    text = backlog.line(view)
    assert text == "backlog estimate 40 (t-0 40); 1 partitions not read yet", text


def test_acquired_beyond_the_watermark_we_knew_is_no_negative_backlog():
    view = backlog.estimate({("t", 0): 10}, {("t", 0): 30}, {})
    assert view["backlogEstimate"] == 0 and view["partitions"]["t-0"]["backlog"] == 0
