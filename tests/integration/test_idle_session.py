"""A share session nobody polls (a long processingTime trigger, an idle host) keeps what librdkafka
queues for it bounded (issue 16): its statistics, one every 100 ms, are served on the session's
thread without polling. No Spark here: a share session on the test's broker."""
from __future__ import annotations

import json

import pytest

from harness.support import ShareGroups, gid, uid, wait_until
from spark_share.consumers.session import IDLE_SERVE_S, STATS_INTERVAL_MS, ShareSession

STATS_PER_SERVE = IDLE_SERVE_S * 1000 / int(STATS_INTERVAL_MS)


class RecordingSession(ShareSession):
    """Remembers, for every statistics callback served, how many ops waited in librdkafka's queue
    when the statistics were taken (``replyq``), and how many ShareAcknowledge requests the consumer
    had sent by then (``acks_sent``: the client's own count, on either broker)."""

    def __init__(self, *args, **kwargs):
        self.replyq: list[int] = []
        self.acks_sent = 0
        super().__init__(*args, **kwargs)

    def _on_stats(self, text: str) -> None:
        super()._on_stats(text)
        st = json.loads(text)
        self.replyq.append(st["replyq"])
        self.acks_sent = sum(b.get("req", {}).get("ShareAcknowledge", 0) for b in st["brokers"].values())


def _session(kafka, topic: str) -> RecordingSession:
    conf = {**kafka.client(), "group.id": kafka.group(gid()), "share.acknowledgement.mode": "explicit"}
    return RecordingSession(uid("idle"), conf, [topic], False)


def test_an_idle_session_keeps_its_queued_statistics_bounded(kafka):
    topic = kafka.create_topic(uid("idle"), 2)
    s = _session(kafka, topic)
    try:
        rb, _ = s.poll(0, 0, None, 60_000).result(timeout=90)  # joins the group; the queue is empty
        assert rb.num_rows == 0
        idle_from = len(s.replyq)
        # No command for the session from here on: only its idle serving runs the callbacks.
        wait_until(lambda: len(s.replyq) - idle_from >= 3 * STATS_PER_SERVE, timeout=20,
                   message="statistics queued in an idle session were not served")
        queued = s.replyq[idle_from:]
        # About STATS_PER_SERVE wait between two serves; a busy machine may delay one or two serves.
        assert max(queued) <= 3 * STATS_PER_SERVE, f"ops waiting in the idle session's queue: {queued}"
        assert s.idle_serves >= 2 and s.polls == 1
    finally:
        s.close().result(timeout=30)


def test_serving_an_idle_session_acknowledges_nothing_and_loses_nothing(kafka, produce):
    """Held records stay held (no acknowledgement goes out) while the session serves its queue, and
    are then accepted; records produced while it idles come with the next poll, delivered once."""
    topic = kafka.create_topic(uid("idle"), 2)
    first = produce(kafka, topic, 10, partitions=2)
    s = _session(kafka, topic)
    try:
        rows = acked = 0
        while rows < len(first):
            rb, _ = s.poll(0, 0, None, 60_000).result(timeout=90)
            assert rb.num_rows, "the records produced before the session started did not come"
            rows += rb.num_rows
            # Statistics that count the acknowledgements sent so far (they come every 100 ms, served late).
            wait_until(lambda: s.acks_sent >= acked, timeout=20, message="no statistics after the last acknowledgement")
            acks, served = s.acks_sent, s.idle_serves
            wait_until(lambda: s.idle_serves >= served + 2, timeout=20, message="the session holding records never served")
            assert s.acks_sent == acks, "serving the queue sent an acknowledgement"
            out = s.acknowledge({}, 30).result(timeout=40)
            acked += 1
            assert (out.accepted, out.failed, out.expired) == (rb.num_rows, 0, 0), out
        later = produce(kafka, topic, 5, partitions=2)
        served = s.idle_serves
        wait_until(lambda: s.idle_serves >= served + 2, timeout=20, message="the idle session never served")
        got = []
        while len(got) < len(later):
            rb, _ = s.poll(1, 0, None, 60_000).result(timeout=90)
            assert rb.num_rows, "records produced while the session idled did not come"
            got += rb.to_pylist()
            assert s.acknowledge({}, 30).result(timeout=40).accepted == rb.num_rows
        assert sorted(json.loads(r["value"])["id"] for r in got) == sorted(later)
        assert {r["deliveryCount"] for r in got} == {1}
    finally:
        s.close().result(timeout=30)


@pytest.mark.embedded_only("reads the group's members through the embedded broker's ctypes API")
def test_a_session_idle_past_max_poll_interval_rejoins_on_its_next_poll(kafka, produce):
    """librdkafka makes a consumer not polled for max.poll.interval.ms leave the group and fails its
    next poll once: the read of that poll must not fail (in local mode it would fail the query)."""
    topic = kafka.create_topic(uid("idle"), 2)
    group = kafka.group(gid())
    conf = {**kafka.client(), "group.id": group, "share.acknowledgement.mode": "explicit",
            "max.poll.interval.ms": "3000"}
    s = RecordingSession(uid("idle"), conf, [topic], False)
    members = ShareGroups(kafka).members
    try:
        assert s.poll(0, 0, None, 60_000).result(timeout=90)[0].num_rows == 0
        assert members(group), "the session did not join"
        wait_until(lambda: not members(group), timeout=30,
                   message="the idle session did not leave the group after max.poll.interval.ms")
        ids = produce(kafka, topic, 10, partitions=2)
        got = []
        while len(got) < len(ids):
            rb, _ = s.poll(1, 0, None, 60_000).result(timeout=90)
            assert rb.num_rows, "the session that left the group did not get the records after rejoining"
            got += rb.to_pylist()
            s.acknowledge({}, 30).result(timeout=40)
        assert sorted(json.loads(r["value"])["id"] for r in got) == sorted(ids)
    finally:
        s.close().result(timeout=30)
