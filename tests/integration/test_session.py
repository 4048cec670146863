"""A share session's polls: an empty one ends when a fetch comes back empty, not at its timeout."""
from __future__ import annotations

import time

import pytest

from harness.support import kafka_options
from spark_share.consumers.session import ShareSession


def test_polls_end_when_a_fetch_comes_back_empty_and_not_while_one_is_on_its_way(kafka, produce):
    """A poll on an empty queue returns once a fetch sent after it began came back empty (the first
    one also waits for the group join: on real Kafka the partitions come one heartbeat after the join,
    5 s by default), long before its timeout; a poll on a queue with records returns them rather than
    giving up."""
    # Kafka's default share heartbeat (5 s) and a fetch, on a real broker; at once on the embedded one.
    first_bound = 5.0 + 3.0 if kafka.external else 5.0
    empty_topic = kafka.create_topic("empty", 1)
    full_topic = kafka.create_topic("full", 1)
    produce(kafka, full_topic, 5)
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit"}
    empty = ShareSession("t-e", dict(conf, **{"group.id": kafka.group("e")}), [empty_topic], False)
    full = ShareSession("t-f", dict(conf, **{"group.id": kafka.group("f")}), [full_topic], False)
    try:
        for attempt in ("first", "later"):
            t0 = time.monotonic()
            rb, held = empty.poll(0, 0, None, 60_000).result(timeout=90)
            took = time.monotonic() - t0
            assert rb.num_rows == 0 and not empty.busy
            assert not held.timed_out, "the broker said the queue is empty: not a poll that ran out of time"
            print(f"the {attempt} empty poll ended after {took:.1f} s")
            assert took < (first_bound if attempt == "first" else 5.0), f"the {attempt} empty poll waited {took:.1f} s"
        rb, _ = full.poll(0, 0, None, 60_000).result(timeout=90)
        assert rb.num_rows == 5
        # A session that found its queue empty still gets what arrives later: on a real broker a fetch
        # already on its way may come back with the first record set alone, the rest with the next poll.
        produce(kafka, empty_topic, 3)
        got, batch, deadline = 0, 1, time.monotonic() + 60
        while got < 3 and time.monotonic() < deadline:
            rb, _ = empty.poll(batch, 0, None, 10_000).result(timeout=90)
            got += rb.num_rows
            if rb.num_rows:
                empty.acknowledge({}, 30).result(timeout=60)
            batch += 1
        assert got == 3
    finally:
        empty.close().result(timeout=30)
        full.close().result(timeout=30)


@pytest.mark.embedded_only("injects broker latency (set_broker_rtt)")
def test_a_poll_that_runs_out_of_time_says_so(kafka, produce):
    """A poll that ends on its timeout before the broker answered anything is not an empty queue: it
    says so (an AvailableNow run goes on after it instead of ending with the queue still full)."""
    topic, group = kafka.create_topic("slow", 1), kafka.group("slow")
    produce(kafka, topic, 5)
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": group}
    kafka.set_broker_rtt(1, 3000)  # every answer 3 s late: the join, then the first fetch
    session = ShareSession("t-slow", conf, [topic], False)
    try:
        rb, held = session.poll(0, 0, None, 500).result(timeout=30)
        assert rb.num_rows == 0 and held.timed_out
        kafka.set_broker_rtt(1, 0)
        rb, held = session.poll(1, 0, None, 60_000).result(timeout=90)
        assert rb.num_rows == 5 and not held.timed_out
        assert session.acknowledge({}, 10).result(timeout=30).accepted == 5
    finally:
        kafka.set_broker_rtt(1, 0)
        session.close().result(timeout=30)


@pytest.mark.embedded_only("injects broker latency (set_broker_rtt); the session reset it guards against "
                           "is the embedded broker's")
def test_a_stalled_broker_does_not_make_the_watermark_client_end_share_sessions(kafka, produce):
    """The watermark client waits out a broker that answers late instead of timing its request out:
    librdkafka drops the connection of a timed-out request, and on the embedded broker that ends
    every share session, so a session's records would come back although it acknowledges in time
    (a 60-minute chaos run looped on this while its broker was slow)."""
    from spark_share.driver.watermarks import REFRESH_TIMEOUT_S, MetadataWatcher
    from spark_share.options import parse_options

    stall_ms, stall_s = 7000, 9.0  # answers come 7 s late, for 9 s
    assert stall_ms / 1000 < REFRESH_TIMEOUT_S
    topic, group = kafka.create_topic("stall", 1), kafka.group("stall")
    produce(kafka, topic, 20)
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": group}
    session = ShareSession("t-s", conf, [topic], False)
    watcher = MetadataWatcher(parse_options({**kafka_options(kafka), "kafka.group.id": group, "subscribe": topic}),
                              wanted=lambda: False)
    try:
        rb, _ = session.poll(0, 0, None, 60_000).result(timeout=90)
        assert rb.num_rows == 20
        kafka.set_broker_rtt(1, stall_ms)
        try:
            t0 = time.monotonic()
            watcher.refresh()
            refresh_s = time.monotonic() - t0
            # The fault lasts stall_s, whatever the refresh did: librdkafka scans for timed-out
            # requests once a second, so a timeout's disconnect lands within it.
            time.sleep(max(0.0, t0 + stall_s - time.monotonic()))
        finally:
            kafka.set_broker_rtt(1, 0)
        out = session.acknowledge({}, 30).result(timeout=60)
        assert (out.accepted, out.failed, out.expired) == (20, 0, 0), out
        assert refresh_s >= stall_ms / 1000 * 0.9, "the refresh did not meet the stall"
        assert watcher.high[(topic, 0)] == 20
    finally:
        watcher.close()
        session.close().result(timeout=30)
