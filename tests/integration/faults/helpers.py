"""Helpers shared by the fault matrix's tracker-only rows: a stub agent connection that records the
commands it gets and answers them, a tracker on a fresh two-partition topic, and a slot's acquired
records reported to a tracker as its agent would."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from harness.support import gid, kafka_options
from spark_share.driver.tracker import Tracker
from spark_share.options import parse_options
from spark_share.transport.protocol import Acquired


class StubAgent(SimpleNamespace):
    """An agent connection for tracker-only tests: records the commands it gets, answers them."""

    def __init__(self, agent_id: str, written=None):
        super().__init__(info={"agent_id": agent_id}, sent=[], closed=False, written=written)

    def call(self, req, blob=b"", timeout=None):
        self.sent.append(req)
        return {"queued": 1}, b""

    def call_async(self, req, blob=b""):
        self.sent.append(req)
        f = Future()
        if req["op"] == "deadletter":
            f.set_result(({"written": len(req["records"]) if self.written is None else self.written}, b""))
        else:
            f.set_result(({"slots": {}}, b""))
        return f

    def wait_closed(self, timeout=None):
        return True


def tracker(kafka, topic, **options) -> tuple[Tracker, str]:
    """A tracker on a new two-partition topic, and the topic's real name."""
    topic = kafka.create_topic(topic, 2)
    return Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()),
                                  "subscribe": topic, **options})), topic


def acquired(t: Tracker, agent, batch: int, slot: int, topic: str, partition: int, first: int, last: int) -> None:
    t._on_acquired(agent, Acquired(batch, slot, rows=last - first + 1, offsets={topic: {str(partition): [[first, last]]}}))
