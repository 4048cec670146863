"""Every message has a name and one handler on the side that receives it; bundled requests (no Spark, no
Kafka)."""
import dataclasses
import threading

import pytest

from harness.support import wait_until
from spark_share.consumers.agent import Agent
from spark_share.driver.tracker import Tracker
from spark_share.errors import BatchRefused, PeerConnectionError, ProtocolError
from spark_share.transport import bundler, endpoints, protocol, wire

WAIT_S = 10


@pytest.mark.parametrize("receiver, receives", [
    (Tracker, protocol.TO_TRACKER),
    (Agent, protocol.TRACKER_TO_AGENT),
    (Agent, protocol.TASK_TO_AGENT),
], ids=["tracker", "agent-from-tracker", "agent-from-tasks"])
def test_each_side_handles_every_message_it_can_receive(receiver, receives):
    for message in (m for m in receives if m is not protocol.Bundle):  # the dispatcher unpacks a bundle
        method = protocol.handler_name(message)
        assert callable(getattr(receiver, method, None)), f"{receiver.__name__}.{method} handles {message.op}"


def test_one_naming_rule_for_handlers():
    assert protocol.handler_name(protocol.Acquired) == "_on_acquired"
    assert protocol.handler_name(protocol.AckResult) == "_on_ack_result"
    assert protocol.handler_name(protocol.DeadLetter) == "_on_dead_letter"
    # A receiver with no handler of ours for a message it is routed fails at once, not at the first request.
    handlers = {n: getattr(Tracker, n) for n in dir(Tracker) if n.startswith("_on_")}
    assert {protocol.handler_name(m) for m in protocol.TO_TRACKER if m is not protocol.Bundle} == set(handlers)


def test_every_message_is_received_somewhere_and_ops_are_unique():
    everything = {m for m in vars(protocol).values()
                  if isinstance(m, type) and issubclass(m, protocol.Message) and m is not protocol.Message}
    received = set(protocol.TO_TRACKER) | set(protocol.TRACKER_TO_AGENT) | set(protocol.TASK_TO_AGENT)
    assert everything == received
    assert len({m.op for m in everything}) == len(everything)


def test_a_message_is_its_header_and_back():
    m = protocol.Acquired(3, 1, rows=2, offsets={"t": {"0": [[5, 6]]}}, poison=[["t", 0, 6, 9]])
    h = m.header()
    assert h["op"] == "acquired" and h["batch"] == 3 and h["offsets"] == {"t": {"0": [[5, 6]]}}
    assert protocol.Acquired.parse(dict(h, unknown_field=1)) == m


class Receiver:
    def _on_claim(self, conn, m):
        return {"owner": f"{m.batch}/{m.slot}"}

    def _on_fetch(self, conn, m):
        return {"rows": 1}, b"ipc"


def test_dispatch_calls_the_one_handler_and_refuses_unknown_or_incomplete():
    handle = protocol.dispatcher(Receiver(), (protocol.Claim, protocol.Fetch))
    assert handle(None, protocol.Claim(2, 1).header(), b"") == ({"owner": "2/1"}, b"")
    assert handle(None, protocol.Fetch(2, 1).header(), b"") == ({"rows": 1}, b"ipc")
    with pytest.raises(ValueError, match="unknown request 'status'"):
        handle(None, {"op": "status"}, b"")
    with pytest.raises(TypeError):  # a required field missing
        handle(None, {"op": "claim", "batch": 1}, b"")
    with pytest.raises(ProtocolError, match="_on_status"):
        protocol.dispatcher(Receiver(), (protocol.Claim, protocol.Status))


def test_messages_are_plain_json_data():
    for m in protocol.TO_TRACKER + protocol.TRACKER_TO_AGENT + protocol.TASK_TO_AGENT:
        for f in dataclasses.fields(m):
            assert f.type in {"int", "str", "float", "bool", "int | None", "str | None", "float | None", "list[list]",
                              "dict[str, dict[str, list[list[int]]]]", "list[dict]"}, (m.op, f.name, f.type)


# --- bundles ------------------------------------------------------------------------------------------
class Tracking:
    """Answers claims (a refused batch as the tracker refuses it) and acquireds, and counts what arrived."""

    def __init__(self, hold_first: threading.Event | None = None):
        self.ops: list[str] = []
        self.hold_first = hold_first
        self.first = threading.Event()

    def _on_claim(self, conn, m):
        self._arrived("claim")
        if m.batch < 0:
            raise BatchRefused(f"batch {m.batch} is over")
        return {"owner": f"{m.batch}/{m.slot}"}

    def _on_acquired(self, conn, m):
        self._arrived("acquired")
        return {"ok": m.slot}

    def _on_fetch(self, conn, m):
        return {"rows": 1}, b"ipc"

    def _arrived(self, op):
        self.ops.append(op)
        if not self.first.is_set():
            self.first.set()
            if self.hold_first is not None:
                assert self.hold_first.wait(WAIT_S)


class Conn:
    def error_reply(self, op, e):
        return {"_error": str(e), "_type": type(e).__name__}


def test_a_bundle_is_answered_request_by_request_in_order():
    handle = protocol.dispatcher(Tracking(), (protocol.Claim, protocol.Acquired, protocol.Fetch, protocol.Bundle))
    bundle = protocol.Bundle([protocol.Claim(2, 1).header(), protocol.Claim(-1, 0).header(),
                              protocol.Acquired(2, 1).header(), protocol.Fetch(2, 1).header(), {"op": "claim"}])
    rep, blob = handle(Conn(), bundle.header(), b"")
    assert blob == b""
    ok, refused, acquired, fetch, incomplete = rep["replies"]
    assert ok == {"owner": "2/1"} and acquired == {"ok": 1}
    assert refused == {"_error": "batch -1 is over", "_type": "BatchRefused"}  # its own error; the rest answered
    assert fetch["_type"] == "ProtocolError" and "cannot come in a bundle" in fetch["_error"]
    assert incomplete["_type"] == "TypeError"  # a field missing
    with pytest.raises(ProtocolError, match="list of requests"):
        handle(Conn(), {"op": "bundle", "requests": "claim"}, b"")
    # A receiver not routed bundles refuses them as any unknown request.
    with pytest.raises(ProtocolError, match="unknown request 'bundle'"):
        protocol.dispatcher(Tracking(), (protocol.Claim,))(Conn(), bundle.header(), b"")


@pytest.fixture
def tracker_conn():
    """A connection to a server that dispatches to the receiver given (as the tracker's does)."""
    made = []

    def make(receiver):
        secret = wire.new_secret()
        srv = endpoints.RpcServer(("127.0.0.1", 0), secret, protocol.dispatcher(
            receiver, (protocol.Claim, protocol.Acquired, protocol.Bundle)), name="tracking")
        conn = endpoints.connect(srv.address, secret)
        made.append((srv, conn))
        return conn
    yield make
    for srv, conn in made:
        conn.close()
        srv.close()


def test_a_request_alone_leaves_at_once_as_itself(tracker_conn):
    receiver = Tracking()
    reads = bundler.Bundler(tracker_conn(receiver))
    try:
        assert reads.call(protocol.Claim(3, 0), timeout=WAIT_S) == ({"owner": "3/0"}, b"")
        assert reads.call(protocol.Acquired(3, 0), timeout=WAIT_S) == ({"ok": 0}, b"")
        with pytest.raises(BatchRefused, match="batch -1 is over"):  # its own kind, as call() raises it
            reads.call(protocol.Claim(-1, 0), timeout=WAIT_S)
        with pytest.raises(ProtocolError, match="cannot come in a bundle"):
            reads.call(protocol.Fetch(3, 0), timeout=WAIT_S)
    finally:
        reads.close()
    assert receiver.ops == ["claim", "acquired", "claim"]  # no bundle of one


def test_requests_made_while_one_is_on_its_way_leave_together_and_each_gets_its_answer(tracker_conn):
    release = threading.Event()
    receiver = Tracking(hold_first=release)
    conn = tracker_conn(receiver)
    bundles = []
    send = conn.call_async
    conn.call_async = lambda header, *a: (bundles.append(header.get("op")), send(header, *a))[1]
    reads = bundler.Bundler(conn)
    results: dict[int, object] = {}

    def read(slot):
        try:
            results[slot] = reads.call(protocol.Claim(-1 if slot == 5 else 4, slot), timeout=WAIT_S)[0]
        except BatchRefused as e:
            results[slot] = e
    try:
        first = threading.Thread(target=read, args=(0,))
        first.start()
        assert receiver.first.wait(WAIT_S)  # the first claim is with the tracker, unanswered
        others = [threading.Thread(target=read, args=(s,)) for s in range(1, 8)]
        for t in others:
            t.start()
        wait_until(lambda: len(reads._queued) == 7, timeout=WAIT_S, message="the other reads did not queue")
        release.set()
        for t in [first, *others]:
            t.join(WAIT_S)
    finally:
        reads.close()
    assert bundles == ["claim", "bundle"]  # eight reads, two messages
    assert {s: r for s, r in results.items() if s != 5} == {s: {"owner": f"4/{s}"} for s in (0, 1, 2, 3, 4, 6, 7)}
    assert isinstance(results[5], BatchRefused)  # one request's error is its caller's alone


def test_a_connection_that_ends_fails_every_request_waiting_in_a_bundle(tracker_conn):
    release = threading.Event()
    receiver = Tracking(hold_first=release)
    conn = tracker_conn(receiver)
    reads = bundler.Bundler(conn)
    errors = []

    def read(slot):
        try:
            reads.call(protocol.Claim(4, slot), timeout=WAIT_S)
        except PeerConnectionError as e:
            errors.append(e)
    threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    try:
        threads[0].start()
        assert receiver.first.wait(WAIT_S)
        for t in threads[1:]:
            t.start()
        wait_until(lambda: len(reads._queued) == 3, timeout=WAIT_S, message="the other reads did not queue")
        conn.close()
        for t in threads:
            t.join(WAIT_S)
    finally:
        release.set()
        reads.close()
    assert len(errors) == 4 and not any(t.is_alive() for t in threads)
