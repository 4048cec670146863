"""Every message has a name and one handler on the side that receives it (no Spark, no Kafka)."""
import dataclasses

import pytest

from spark_share.driver.tracker import Tracker
from spark_share.executor.agent import Agent
from spark_share.transport import protocol


@pytest.mark.parametrize("receiver, table, receives", [
    (Tracker, Tracker.HANDLERS, protocol.TO_TRACKER),
    (Agent, Agent.FROM_TRACKER, protocol.TRACKER_TO_AGENT),
    (Agent, Agent.FROM_TASKS, protocol.TASK_TO_AGENT),
], ids=["tracker", "agent-from-tracker", "agent-from-tasks"])
def test_each_side_handles_every_message_it_can_receive(receiver, table, receives):
    assert set(table) == set(receives)
    for message, method in table.items():
        assert callable(getattr(receiver, method, None)), f"{receiver.__name__}.{method} handles {message.op}"


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
    def on_claim(self, conn, m):
        return {"owner": f"{m.batch}/{m.slot}"}

    def on_fetch(self, conn, m):
        return {"rows": 1}, b"ipc"


def test_dispatch_calls_the_one_handler_and_refuses_unknown_or_incomplete():
    handle = protocol.dispatcher(Receiver(), {protocol.Claim: "on_claim", protocol.Fetch: "on_fetch"},
                                 (protocol.Claim, protocol.Fetch))
    assert handle(None, protocol.Claim(2, 1).header(), b"") == ({"owner": "2/1"}, b"")
    assert handle(None, protocol.Fetch(2, 1).header(), b"") == ({"rows": 1}, b"ipc")
    with pytest.raises(ValueError, match="unknown request 'status'"):
        handle(None, {"op": "status"}, b"")
    with pytest.raises(TypeError):  # a required field missing
        handle(None, {"op": "claim", "batch": 1}, b"")
    with pytest.raises(TypeError, match="receives"):
        protocol.dispatcher(Receiver(), {protocol.Claim: "on_claim"}, (protocol.Claim, protocol.Fetch))


def test_messages_are_plain_json_data():
    for m in protocol.TO_TRACKER + protocol.TRACKER_TO_AGENT + protocol.TASK_TO_AGENT:
        for f in dataclasses.fields(m):
            assert f.type in {"int", "str", "float", "bool", "int | None", "str | None", "float | None", "list[list]",
                              "dict[str, dict[str, list[list[int]]]]"}, (m.op, f.name, f.type)
