"""Every message has a name and one handler on the side that receives it (no Spark, no Kafka)."""
import dataclasses

import pytest

from spark_share.driver.tracker import Tracker
from spark_share.errors import ProtocolError
from spark_share.executor.agent import Agent
from spark_share.transport import protocol


@pytest.mark.parametrize("receiver, receives", [
    (Tracker, protocol.TO_TRACKER),
    (Agent, protocol.TRACKER_TO_AGENT),
    (Agent, protocol.TASK_TO_AGENT),
], ids=["tracker", "agent-from-tracker", "agent-from-tasks"])
def test_each_side_handles_every_message_it_can_receive(receiver, receives):
    for message in receives:
        method = protocol.handler_name(message)
        assert callable(getattr(receiver, method, None)), f"{receiver.__name__}.{method} handles {message.op}"


def test_one_naming_rule_for_handlers():
    assert protocol.handler_name(protocol.Acquired) == "_on_acquired"
    assert protocol.handler_name(protocol.AckResult) == "_on_ack_result"
    assert protocol.handler_name(protocol.DeadLetter) == "_on_dead_letter"
    # A receiver with no handler of ours for a message it is routed fails at once, not at the first request.
    handlers = {n: getattr(Tracker, n) for n in dir(Tracker) if n.startswith("_on_")}
    assert {protocol.handler_name(m) for m in protocol.TO_TRACKER} == set(handlers)


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
                              "dict[str, dict[str, list[list[int]]]]"}, (m.op, f.name, f.type)
