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
from spark_share.verdict_set import VerdictSet


class StubAgent(SimpleNamespace):
    """An agent connection for tracker-only tests: records the commands it gets, answers them."""

    def __init__(self, agent_id: str, written=None):
        super().__init__(info={"agent_id": agent_id}, sent=[], closed=False, written=written, staged={})

    def call(self, req, blob=b"", timeout=None):
        self.sent.append(req)
        return {"queued": 1}, b""

    def call_async(self, req, blob=b""):
        f = Future()
        if req["op"] == "stage":  # verdict chunks ahead of the request that uses them
            self.staged.setdefault((req["batch"], req["purpose"]), []).append(blob)
            f.set_result(({"staged": True}, b""))
            return f
        self.sent.append(req)
        if req["op"] == "deadletter":
            rejects = VerdictSet.from_chunks(self.staged.get((req["batch"], "deadletter"), []))
            f.set_result(({"written": len(rejects) if self.written is None else self.written}, b""))
        elif req["op"] == "ack":
            f.set_result(({"queued": 1}, b""))
        else:
            f.set_result(({"slots": {}}, b""))
        return f

    def wait_closed(self, timeout=None):
        return True

    def dead_letters(self) -> list[list]:
        """The [topic, partition, offset, reason] rows of each DeadLetter it got (staged before it)."""
        out = []
        for r in self.sent:
            if r["op"] == "deadletter":
                rows = VerdictSet.from_chunks(self.staged.get((r["batch"], "deadletter"), [])).to_table().to_pylist()
                out.append([[x["topic"], x["partition"], x["offset"], x["reason"]] for x in rows])
        return out

    def acks(self) -> list[tuple[int, list]]:
        """(default, the [topic, partition, offset, kind] of its staged verdicts) of each Ack it got."""
        return [(r["default"], [list(v) for v in VerdictSet.from_chunks(self.staged.get((r["batch"], "ack"), [])).records()])
                for r in self.sent if r["op"] == "ack"]


def give(b, *verdicts: tuple) -> None:
    """reject()/release() of (topic, partition, offset, kind[, reason]) rows of batch ``b``."""
    b.verdicts.update(VerdictSet.from_records(verdicts))


def tracker(kafka, topic, **options) -> tuple[Tracker, str]:
    """A tracker on a new two-partition topic, and the topic's real name."""
    topic = kafka.create_topic(topic, 2)
    return Tracker(parse_options({**kafka_options(kafka), "kafka.group.id": kafka.group(gid()),
                                  "subscribe": topic, **options})), topic


def acquired(t: Tracker, agent, batch: int, slot: int, topic: str, partition: int, first: int, last: int) -> None:
    t._on_acquired(agent, Acquired(batch, slot, rows=last - first + 1, offsets={topic: {str(partition): [[first, last]]}}))
