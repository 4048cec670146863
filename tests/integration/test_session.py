"""A share session's polls: an empty one ends when a fetch comes back empty, not at its timeout."""
from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures

import pytest

from harness.support import ShareGroups, kafka_options, wait_until
from spark_share.consumers.pool import SessionPool
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


def test_the_first_members_of_a_new_group_get_their_partitions_long_before_its_second_heartbeat(kafka, produce):
    """Kafka sets a new group's partitions up at its first members' first heartbeat and hands them out at a
    later one: one heartbeat interval after the join (here the longest a group may have by default, 15 s).
    The sessions subscribe again while they have no partitions, which sends that heartbeat at once: both
    get their partitions, and records, within a third of the interval. (The embedded broker assigns at the
    join, and may give the first member every record.)"""
    kafka.set_heartbeat_interval(15_000)
    # A broker's first share group waits for the share coordinator too: not what this test measures.
    warm_conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": kafka.group("warm")}
    warm = ShareSession("t-warm", warm_conf, [kafka.create_topic("warm", 1)], False)
    try:
        _poll_until_assigned(warm)
    finally:
        warm.close().result(timeout=30)
    topic, group = kafka.create_topic("new-group", 4), kafka.group("new-group")
    produce(kafka, topic, 400)
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": group}
    sessions = [ShareSession(f"t-new-{i}", conf, [topic], False) for i in range(2)]
    try:
        polls = [s.poll(0, i, None, 5_000) for i, s in enumerate(sessions)]
        got = 0
        for s, poll in zip(sessions, polls):
            rb, _ = poll.result(timeout=90)
            took = time.monotonic() - s.created_at
            print(f"{s.session_id}: {rb.num_rows} records {took:.1f} s after it joined, partitions {sorted(s.assigned())}")
            assert (rb.num_rows or s.assigned()) and took < 5.0, \
                f"{s.session_id}: {rb.num_rows} records and no partition {took:.1f} s after joining"
            got += rb.num_rows
            if rb.num_rows:
                s.acknowledge({}, 30).result(timeout=60)
        assert got
    finally:
        wait_futures([s.close() for s in sessions], timeout=60)


def test_records_fetched_while_no_poll_ran_come_with_a_fresh_lock(kafka, produce):
    """After a poll that returned nothing, the client fetches on its own and keeps what comes for the next
    poll, while the broker's lock on it runs (a long processingTime trigger polls minutes apart). A poll
    after the records' lock ran out gives them back and fetches them again: the batch holds them with a
    fresh lock, and their ACCEPT holds (before, the batch got records whose lock had expired, and every
    ACCEPT failed)."""
    lock_ms = 3000
    kafka.set_record_lock_duration(lock_ms)
    topic, group = kafka.create_topic("idle-fetch", 1), kafka.group("idle-fetch")
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": group}
    session = ShareSession("t-idle", conf, [topic], False)
    try:
        _poll_until_assigned(session)
        produce(kafka, topic, 20)
        stats = session._fetch_stats
        came = wait_until(lambda: stats.fetched_after, timeout=30, message="the client fetched nothing on its own")
        wait_until(lambda: time.monotonic() > came + lock_ms / 1000 + 0.5, timeout=30)  # the lock runs out
        rb, held = session.poll(1, 0, None, 30_000, carry_ms=lock_ms / 2).result(timeout=60)
        assert rb.num_rows == 20 and session.released_old == 20
        assert set(rb.column("deliveryCount").to_pylist()) == {2}, "fetched again after the release"
        outcome = session.acknowledge({}, 30).result(timeout=60)
        assert outcome.accepted == 20 and not outcome.failed and not outcome.expired, outcome
    finally:
        session.close().result(timeout=30)


def _poll_until_assigned(session: ShareSession) -> None:
    """Empty polls until the member has its partition, then one more: the client fetches on its own only
    after a poll that ran while it had one. (On Kafka a new member can be steady with none for a heartbeat
    or more, while the broker initialises the partition's share state; its poll then ends at once.)"""
    def assigned() -> bool:
        rb, _ = session.poll(0, 0, None, 2_000).result(timeout=90)
        assert rb.num_rows == 0
        state = session._fetch_stats.state(0.0)
        return state is not None and state.assigned
    wait_until(assigned, timeout=60, message="the member got no partition")
    assert session.poll(0, 0, None, 2_000).result(timeout=90)[0].num_rows == 0


@pytest.mark.parametrize("order", ["close_all", pytest.param("holder first", marks=pytest.mark.embedded_only(
    "shows the hazard on a partition shared by hand; on Kafka the broker decides whether the two share it"))])
def test_a_stopping_pool_closes_its_idle_sessions_before_the_ones_that_release_records(kafka, produce, order):
    """Two sessions share a partition (Kafka shares one between members; the embedded broker is told to). One
    holds 50 records, the other's last poll returned nothing, so its client fetches on its own. Closed
    holder first, the idle one acquires what the holder released and drops it as it closes: the records'
    next delivery is their third, one spent unseen. ``close_all`` closes the idle one first: their second.
    (On the embedded broker a client's disconnect ends every share session, which hides the race when both
    close at once; the order itself is ``test_pool.py``'s.)"""
    if not kafka.external:
        kafka.set_heartbeat_interval(200)  # the members learn the manual assignment within ~0.2 s
    topic, group = kafka.create_topic("close-order", 1), kafka.group(f"close-order-{order[0]}")
    conf = {**kafka.client(), "share.acknowledgement.mode": "explicit", "group.id": group}
    pool = SessionPool(lambda size, replay=False: ShareSession(f"t-close-{len(pool.sessions)}", conf, [topic], False), "test")
    pool.start(2)
    try:
        if not kafka.external:
            groups = ShareGroups(kafka)
            wait_until(lambda: len(groups.members(group)) == 2, timeout=30, message="both sessions joined")
            groups.assign(group, {m: [(topic, 0)] for m in groups.members(group)})
        holder, idle = pool.sessions
        produce(kafka, topic, 50)
        rb, _ = holder.poll(0, 0, None, 30_000).result(timeout=60)
        assert rb.num_rows == 50 and set(rb.column("deliveryCount").to_pylist()) == {1}
        rb, held = idle.poll(0, 1, None, 30_000).result(timeout=60)
        assert rb.num_rows == 0 and not held.timed_out
        if order == "close_all":
            wait_futures(pool.close_all(), timeout=30)
        else:
            holder.close().result(timeout=30)
            wait_until(lambda: idle._fetch_stats.fetched_after, timeout=30,
                       message="the idle session's client did not acquire what the holder released")
            idle.close().result(timeout=30)
    except BaseException:  # the sessions a failed step left open
        wait_futures(pool.close_all(), timeout=30)
        raise
    reader = ShareSession("t-close-reader", conf, [topic], False)
    try:
        if not kafka.external:  # the group's assignment is manual now: the partition to the reader too
            wait_until(lambda: len(groups.members(group)) == 1, timeout=30, message="the reader alone in the group")
            groups.assign(group, {m: [(topic, 0)] for m in groups.members(group)})
        rb, _ = reader.poll(1, 0, None, 30_000).result(timeout=60)
        assert rb.num_rows == 50
        assert set(rb.column("deliveryCount").to_pylist()) == ({2} if order == "close_all" else {3})
        reader.acknowledge({}, 30).result(timeout=60)
    finally:
        reader.close().result(timeout=30)


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
