"""The embedded broker (librdkafka's mock cluster) against confluent-kafka clients, and the CLI.

No test sleeps to synchronise: waits are bounded polls (``poll_until``/``poll_for``) or
``wait_until``. Observed mock behaviour that the tests rely on is stated where it is used.
"""
from __future__ import annotations

import gc
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from confluent_kafka import AcknowledgeType, Producer, ShareConsumer

from harness.support import ShareGroups, wait_until
from spark_share import embedded
from spark_share.embedded import EmbeddedKafka, EmbeddedKafkaError, parse_topic_spec

ERR_NOT_LEADER_OR_FOLLOWER = 6
ERR_INVALID_RECORD_STATE = 121
ACCEPT, RELEASE, REJECT = AcknowledgeType.ACCEPT, AcknowledgeType.RELEASE, AcknowledgeType.REJECT
pytestmark = pytest.mark.embedded_only("tests of the embedded broker itself (EmbeddedKafka, its quirks, its "
                                       "error injection) and of its CLI")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def share_consumer(kafka, group="g", topics=("t",), **conf):
    c = ShareConsumer({"bootstrap.servers": kafka.bootstrap_servers, "group.id": group,
                       "share.acknowledgement.mode": "explicit", **conf})
    c.subscribe(list(topics))
    return c


def poll_until(c, n, timeout=15.0):
    """Poll (without acknowledging) until ``n`` records arrived or ``timeout`` s passed. In explicit
    mode the caller must acknowledge them before polling this consumer again."""
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += [m for m in c.poll(0.1) if m.error() is None]
    return got


def poll_for(c, seconds, ack=ACCEPT):
    """Everything a consumer gets within ``seconds`` (acknowledged with ``ack`` and committed)."""
    got = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        msgs = [m for m in c.poll(0.1) if m.error() is None]
        for m in msgs:
            c.acknowledge(m, ack)
        if msgs:
            assert all(e is None for e in c.commit_sync(10).values())
        got += msgs
    return got


def drain(c, want, timeout=15.0, ack=ACCEPT):
    """Poll, acknowledge and commit until the (partition, offset)s in ``want`` were all seen."""
    got = []
    want = set(want)
    deadline = time.monotonic() + timeout
    while not want <= {(m.partition(), m.offset()) for m in got} and time.monotonic() < deadline:
        msgs = [m for m in c.poll(0.1) if m.error() is None]
        for m in msgs:
            c.acknowledge(m, ack)
        if msgs:
            assert all(e is None for e in c.commit_sync(10).values())
        got += msgs
    return got


def codes(commit_result):
    return {tp.partition: (e.args[0].code() if e is not None else None) for tp, e in commit_result.items()}


# --- acknowledgement types -------------------------------------------------------------------
def test_accept_release_reject(kafka, produce):
    kafka.create_topic("t", 1)
    ids = produce(kafka, "t", 30, partitions=1)
    c = share_consumer(kafka)
    try:
        msgs = poll_until(c, 30)
        assert sorted(m.offset() for m in msgs) == list(range(30))
        assert sorted(json.loads(m.value())["id"] for m in msgs) == sorted(ids)
        assert all(m.key() == str(json.loads(m.value())["id"]).encode() for m in msgs)
        assert {m.delivery_count() for m in msgs} == {1}
        kind = {0: ACCEPT, 1: RELEASE, 2: REJECT}
        for m in msgs:
            c.acknowledge(m, kind[m.offset() % 3])
        assert set(codes(c.commit_sync(10)).values()) == {None}
        released = [o for o in range(30) if o % 3 == 1]
        again = poll_until(c, len(released))
        # RELEASEd records come back at once, with a higher delivery count ...
        assert sorted(m.offset() for m in again) == released
        assert {m.delivery_count() for m in again} == {2}
        for m in again:
            c.acknowledge(m, ACCEPT)
        assert set(codes(c.commit_sync(10)).values()) == {None}
        # ... ACCEPTed and REJECTed ones never (bounded look: 1 s, released ones took ~0.1 s).
        assert poll_for(c, 1.0) == []
    finally:
        c.close()


def test_release_raises_the_delivery_count_until_archived(kafka, produce):
    kafka.set_max_delivery_attempts(3)
    kafka.create_topic("t", 1)
    produce(kafka, "t", 4, partitions=1)
    c = share_consumer(kafka)
    try:
        seen = []
        for attempt in (1, 2, 3):
            msgs = poll_until(c, 4)
            assert sorted(m.offset() for m in msgs) == [0, 1, 2, 3], f"attempt {attempt}"
            assert {m.delivery_count() for m in msgs} == {attempt}
            seen.append(attempt)
            for m in msgs:
                c.acknowledge(m, RELEASE)
            assert set(codes(c.commit_sync(10)).values()) == {None}
        # The third RELEASE reached the delivery limit: the records are archived, not redelivered.
        assert poll_for(c, 1.0) == []
        assert seen == [1, 2, 3]
    finally:
        c.close()


def test_reject_is_never_redelivered(kafka, produce):
    kafka.create_topic("t", 1)
    produce(kafka, "t", 10, partitions=1)
    c = share_consumer(kafka)
    try:
        msgs = poll_until(c, 10)
        assert len(msgs) == 10
        for m in msgs:
            c.acknowledge(m, REJECT if m.offset() < 5 else RELEASE)
        assert set(codes(c.commit_sync(10)).values()) == {None}
        later = poll_for(c, 1.5)
        offsets = sorted(m.offset() for m in later)
        assert offsets == [5, 6, 7, 8, 9], offsets  # released: back; rejected: never
    finally:
        c.close()


# --- acquisition locks -----------------------------------------------------------------------
def test_lock_expiry_redelivers_to_another_member(kafka, produce):
    """A member holds records past the lock without acknowledging; another member gets them with
    delivery count 2, and the first member's late ACCEPT fails with INVALID_RECORD_STATE.

    Mock specifics this test works around (measured while writing it):
    - its assignor gives the single partition to ONE member, so the second member idles while
      the first is alive; ``ShareGroups.assign`` puts the partition on both (manual assignment);
    - a member JOINING ends the share sessions of the others (their locked records are released
      at once, not on lock expiry), so both members join before any record is acquired;
    - a poll leaves a ShareFetch in flight whose records are acquired and buffered for the next
      poll, so whichever member fetched first, the test follows the records the first member
      actually returned to the application;
    - locks are reclaimed by a 1 s timer: redelivery comes 1-2 s after a 1000 ms lock.
    """
    lock_ms = 1000
    kafka.set_record_lock_duration(lock_ms)
    kafka.set_heartbeat_interval(200)  # members learn the manual assignment within ~0.2 s
    kafka.create_topic("t", 1)
    groups = ShareGroups(kafka)
    c1, c2 = share_consumer(kafka), share_consumer(kafka)
    try:
        wait_until(lambda: (c1.poll(0.05), c2.poll(0.05)) and len(groups.members("g")) == 2,
                   timeout=15, message="both consumers joined the share group")
        groups.assign("g", {m: [("t", 0)] for m in groups.members("g")})
        # A marker proves the assignment reached the members; whoever gets it accepts it.
        produce(kafka, "t", [{"marker": True}], partitions=1)
        marker = []

        def got_marker():
            for c in (c1, c2):
                msgs = [m for m in c.poll(0.05) if m.error() is None]
                for m in msgs:
                    c.acknowledge(m, ACCEPT)
                if msgs:
                    assert set(codes(c.commit_sync(10)).values()) == {None}
                marker.extend(msgs)
            return marker

        wait_until(got_marker, timeout=15, message="the marker record was delivered")

        t_produced = time.monotonic()
        produce(kafka, "t", 5, partitions=1)
        # Whichever member returns records first holds them; it then neither polls nor acknowledges.
        held, roles = [], []

        def someone_acquired():
            for c, other in ((c1, c2), (c2, c1)):
                msgs = [m for m in c.poll(0.05) if m.error() is None]
                if msgs:
                    held.extend(msgs)
                    roles.extend((c, other))
                    return True
            return False

        wait_until(someone_acquired, timeout=15, message="a consumer acquired records")
        holder, taker = roles
        assert {m.delivery_count() for m in held} == {1}
        held_offsets = {m.offset() for m in held}
        back, seen_at, late = {}, {}, {}
        rest = []

        def taker_got_held_ones():
            msgs = [m for m in taker.poll(0.1) if m.error() is None]
            now = time.monotonic() - t_produced
            for m in msgs:
                if m.offset() in held_offsets:
                    back[m.offset()] = m.delivery_count()
                    seen_at[m.offset()] = now
                else:
                    rest.append(m)
            if back and not late:
                # The late ACCEPT from the member whose lock expired, while the other member holds
                # the records, is refused. (Observed: once the other member has ACCEPTed them, the
                # mock answers a late ACCEPT with success; a real broker refuses it too.)
                for m in held:
                    holder.acknowledge(m, ACCEPT)
                late.update(codes(holder.commit_sync(10)))
            for m in msgs:
                taker.acknowledge(m, ACCEPT)
            if msgs:
                assert set(codes(taker.commit_sync(10)).values()) == {None}
            return set(back) == held_offsets

        wait_until(taker_got_held_ones, timeout=15, message="the held records were redelivered")
        assert set(back.values()) == {2}, back
        assert late == {0: ERR_INVALID_RECORD_STATE}, late
        earliest = min(seen_at.values())
        assert earliest >= lock_ms / 1000 * 0.95, f"redelivered after {earliest:.2f} s, before the lock expired"
        assert earliest < lock_ms / 1000 + 3, f"redelivered only after {earliest:.2f} s"
        print(f"lock {lock_ms} ms: redelivered to the other member after {earliest:.2f} s; "
              f"holder returned {len(held_offsets)}, the other acquired {len(rest)} directly")
        assert {m.offset() for m in rest} | held_offsets == {1, 2, 3, 4, 5}
    finally:
        c2.close()
        c1.close()


# --- several processes -----------------------------------------------------------------------
CONSUMER_SCRIPT = textwrap.dedent("""
    import json, sys, threading
    from confluent_kafka import ShareConsumer, AcknowledgeType
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    c = ShareConsumer({"bootstrap.servers": sys.argv[1], "group.id": "split",
                       "share.acknowledgement.mode": "explicit"})
    c.subscribe(["t"])
    c.poll(0.1)
    print("ready", flush=True)
    while not stop.is_set():
        msgs = [m for m in c.poll(0.1) if m.error() is None]
        for m in msgs:
            c.acknowledge(m, AcknowledgeType.ACCEPT)
        if msgs:
            errors = [str(e) for e in c.commit_sync(10).values() if e is not None]
            print(json.dumps({"got": [[m.partition(), m.offset()] for m in msgs], "errors": errors}), flush=True)
    c.close()
    print(json.dumps({"closed": True}), flush=True)
""")


def test_two_consumer_processes_split_a_topic(kafka, produce):
    kafka.set_heartbeat_interval(200)
    kafka.create_topic("t", 4)
    groups = ShareGroups(kafka)
    procs = [subprocess.Popen([sys.executable, "-c", CONSUMER_SCRIPT, kafka.bootstrap_servers],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    lines: queue.Queue = queue.Queue()
    try:
        for i, pr in enumerate(procs):
            threading.Thread(target=lambda i=i, pr=pr: [lines.put((i, ln)) for ln in pr.stdout], daemon=True).start()
        ready = set()
        wait_until(lambda: _drain_lines(lines, ready) or len(ready) == 2, timeout=30, message="consumers ready")
        wait_until(lambda: len(groups.members("split")) == 2, timeout=15, message="both processes in the group")
        n = 2000
        produce(kafka, "t", n, partitions=4)
        got = {0: [], 1: []}
        errors = []

        def all_seen():
            for i, msg in _lines(lines):
                got[i] += [tuple(x) for x in msg.get("got", [])]
                errors.extend(msg.get("errors", []))
            return len(set(got[0]) | set(got[1])) >= n

        wait_until(all_seen, timeout=60, message="all records consumed")
        for pr in procs:
            pr.stdin.close()  # the consumers stop, close and exit
        for pr in procs:
            assert pr.wait(timeout=30) == 0
        all_seen()  # whatever they printed after the stop
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.kill()
                pr.wait()
    seen = got[0] + got[1]
    assert not errors, errors[:5]
    assert len(seen) == len(set(seen)) == n, f"{len(seen)} deliveries, {len(set(seen))} distinct, {n} produced"
    assert {p for p, _ in seen} == {0, 1, 2, 3}
    assert got[0] and got[1], "one consumer got nothing: the topic was not split"
    # The mock's assignor gives each partition to one member: the two sets of partitions are disjoint.
    assert not ({p for p, _ in got[0]} & {p for p, _ in got[1]}), "a partition went to both consumers"


def _lines(q):
    out = []
    while True:
        try:
            i, ln = q.get_nowait()
        except queue.Empty:
            return out
        ln = ln.strip()
        if ln.startswith("{"):
            out.append((i, json.loads(ln)))


def _drain_lines(q, ready):
    while True:
        try:
            i, ln = q.get_nowait()
        except queue.Empty:
            return False
        if ln.strip() == "ready":
            ready.add(i)


# --- error injection -------------------------------------------------------------------------
def test_share_acknowledge_errors_fail_the_commit_and_records_come_back(kafka, produce):
    kafka.create_topic("t", 2)
    produce(kafka, "t", 20, partitions=2)
    c = share_consumer(kafka)
    try:
        msgs = poll_until(c, 20)
        assert len(msgs) == 20
        # A request-level error: every partition of the request reports it ...
        for m in msgs:
            c.acknowledge(m, ACCEPT)
        kafka.push_request_errors("ShareAcknowledge", [ERR_INVALID_RECORD_STATE])
        assert codes(c.commit_sync(10)) == {0: ERR_INVALID_RECORD_STATE, 1: ERR_INVALID_RECORD_STATE}
        # ... and, the acknowledgement lost, all records are delivered again.
        again = poll_until(c, 20)
        assert sorted((m.partition(), m.offset()) for m in again) == sorted((m.partition(), m.offset()) for m in msgs)
        assert {m.delivery_count() for m in again} == {2}
        # A partition-level error: only that partition fails, and only its records come back.
        for m in again:
            c.acknowledge(m, ACCEPT)
        kafka.push_partition_request_errors("t", 1, "ShareAcknowledge", [ERR_INVALID_RECORD_STATE])
        assert codes(c.commit_sync(10)) == {0: None, 1: ERR_INVALID_RECORD_STATE}
        third = drain(c, {(1, m.offset()) for m in again if m.partition() == 1})
        assert {m.partition() for m in third} == {1}
        assert poll_for(c, 0.5) == []
    finally:
        c.close()


def test_share_fetch_errors_are_retried_without_loss(kafka, produce):
    kafka.create_topic("t", 1)
    produce(kafka, "t", 20, partitions=1)
    c = share_consumer(kafka)
    try:
        # Two failing ShareFetch answers, each 700 ms late: the client retries; nothing is lost
        # or delivered twice, and the delay shows the injected answers were the ones served.
        kafka.push_broker_request_errors(1, "ShareFetch", [(ERR_NOT_LEADER_OR_FOLLOWER, 700)] * 2)
        t0 = time.monotonic()
        got = drain(c, {(0, o) for o in range(20)})
        took = time.monotonic() - t0
        assert sorted(m.offset() for m in got) == list(range(20))
        assert {m.delivery_count() for m in got} == {1}
        assert took >= 1.3, f"all records after {took:.2f} s: the injected errors were not served"
        # Plain request errors (no delay) are retried the same way.
        produce(kafka, "t", 10, partitions=1)
        kafka.push_request_errors("ShareFetch", [ERR_NOT_LEADER_OR_FOLLOWER] * 3)
        more = drain(c, {(0, o) for o in range(20, 30)})
        assert sorted(m.offset() for m in more) == list(range(20, 30))
    finally:
        c.close()


def test_broker_down_and_up(kafka, produce):
    kafka.create_topic("t", 1)
    produce(kafka, "t", 10, partitions=1)
    c = share_consumer(kafka, **{"max.poll.records": 5})
    try:
        first = poll_until(c, 1)
        assert first and {m.delivery_count() for m in first} == {1}
        for m in first:
            c.acknowledge(m, ACCEPT)
        kafka.broker_down(1)
        # The acknowledgement cannot reach the broker (observed: NOT_LEADER_OR_FOLLOWER at once).
        result = codes(c.commit_sync(5))
        assert result and all(code is not None for code in result.values()), result
        assert poll_for(c, 1.0) == []
        kafka.broker_up(1)
        got = drain(c, {(0, o) for o in range(10)}, timeout=30)
        assert sorted({m.offset() for m in got}) == list(range(10))
        # The lost ACCEPT means the first records come again, with a higher delivery count.
        assert {m.delivery_count() for m in got if m.offset() in {f.offset() for f in first}} == {2}
    finally:
        c.close()


# --- lifecycle -------------------------------------------------------------------------------
def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_shutdown_leaves_no_thread_behind():
    # No other client is created here; clients of earlier tests that are still alive keep a
    # constant number of threads (gc first, so none is finalised in the middle).
    gc.collect()
    with EmbeddedKafka() as k:  # warm up: library load, first-time allocations
        k.create_topic("t", 1)
    py_before = {t.ident for t in threading.enumerate()}
    before = _os_threads()
    for _ in range(5):
        k = EmbeddedKafka(brokers=2)
        k.create_topic("t", 2)
        assert _os_threads() > before  # the cluster's threads are visible while it runs
        k.close()
        k.close()  # idempotent
    wait_until(lambda: _os_threads() <= before, timeout=10,
               message=f"OS threads left behind ({_os_threads()} vs {before})")
    assert {t.ident for t in threading.enumerate()} <= py_before
    assert not k.running
    with pytest.raises(EmbeddedKafkaError, match="closed"):
        k.create_topic("x", 1)


def test_closed_on_exception():
    with pytest.raises(RuntimeError):
        with EmbeddedKafka() as k:
            raise RuntimeError("boom")
    assert not k.running


def test_missing_symbol_names_the_needed_version(monkeypatch):
    monkeypatch.setattr(embedded, "_lib", None)
    monkeypatch.setitem(embedded._SIGNATURES, "rd_kafka_mock_sharegroup_from_the_future", ([], None))
    with pytest.raises(EmbeddedKafkaError, match=r"confluent-kafka>=2\.16\.1") as e:
        EmbeddedKafka()
    assert "rd_kafka_mock_sharegroup_from_the_future" in str(e.value)


def test_missing_library_names_the_needed_version(monkeypatch):
    monkeypatch.setattr(embedded, "_lib", None)
    monkeypatch.setattr(embedded.glob, "glob", lambda pattern: [])
    with pytest.raises(EmbeddedKafkaError, match=r"confluent-kafka>=2\.16\.1"):
        EmbeddedKafka()


def test_parse_topic_spec():
    assert parse_topic_spec("orders:4") == ("orders", 4)
    assert parse_topic_spec("orders") == ("orders", 1)
    for bad in ("", ":3", "a:x", "a:0", "a:-1"):
        with pytest.raises(ValueError):
            parse_topic_spec(bad)


# --- CLI -------------------------------------------------------------------------------------
def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "spark_share.cli", *args], cwd=REPO, text=True, **kw)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_broker_command_serves_until_interrupted(sig):
    proc = _cli("broker", "--topic", "t:2", stdout=subprocess.PIPE)
    p = c = None
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("bootstrap.servers=127.0.0.1:"), line
        bootstrap = line.split("=", 1)[1]
        assert "Ctrl-C" in proc.stdout.readline()
        p = Producer({"bootstrap.servers": bootstrap})
        for part in (0, 1):
            p.produce("t", value=b"hello-%d" % part, partition=part)
        assert p.flush(10) == 0
        c = ShareConsumer({"bootstrap.servers": bootstrap, "group.id": "cli",
                           "share.acknowledgement.mode": "explicit"})
        c.subscribe(["t"])
        msgs = poll_until(c, 2)
        assert sorted(m.value() for m in msgs) == [b"hello-0", b"hello-1"]  # both partitions exist
        for m in msgs:
            c.acknowledge(m, ACCEPT)
        assert set(codes(c.commit_sync(10)).values()) == {None}
        c.close()
        c = None
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if c is not None:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        del p


def test_broker_command_rejects_a_bad_topic():
    proc = _cli("broker", "--topic", "t:zero", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "PARTITIONS" in err


def test_produce_command_writes_orders_and_malformed_records(kafka):
    kafka.create_topic("orders", 1)
    out = subprocess.run([sys.executable, "-m", "spark_share.cli", "produce", "--bootstrap-servers",
                          kafka.bootstrap_servers, "--topic", "orders", "--count", "200", "--malformed", "0.25"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "produced 200 records" in out.stdout
    c = share_consumer(kafka, topics=("orders",))
    try:
        msgs = drain(c, {(0, o) for o in range(200)})
    finally:
        c.close()
    good, bad = [], []
    for m in msgs:
        try:
            good.append(json.loads(m.value()))
        except ValueError:
            bad.append(m)
    assert len(good) + len(bad) == 200
    assert 20 <= len(bad) <= 80, len(bad)  # ~25 %
    assert {"order_id", "customer", "amount", "ts"} <= set(good[0])
    assert sorted([g["order_id"] for g in good] + [int(m.key()) for m in bad]) == list(range(200))


@pytest.mark.parametrize("args", [["--help"], ["broker", "--help"], ["produce", "--help"], ["demo", "--help"]])
def test_cli_help(args):
    out = subprocess.run([sys.executable, "-m", "spark_share.cli", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_cli_without_a_command_fails():
    out = subprocess.run([sys.executable, "-m", "spark_share.cli"], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "usage:" in out.stderr


def test_demo_command_reports_a_missing_demo(monkeypatch, capsys):
    from spark_share import cli

    real = cli.importlib.import_module

    def fake(name, *a):
        if name == "spark_share.demo":
            raise ModuleNotFoundError("No module named 'spark_share.demo'", name="spark_share.demo")
        return real(name, *a)

    monkeypatch.setattr(cli.importlib, "import_module", fake)
    assert cli.main(["demo"]) == 1
    assert "not available" in capsys.readouterr().err
    assert cli.main(["demo", "--help"]) == 0
