"""The tracker's agents (spark_share/driver/agents.py) against fake connections: what an agent is told
when it joins (never a credential), prefetch only on one host, a re-read relayed to the agent that holds
the slot, an agent leaving, the per-host view, and the stop of every agent."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from spark_share.driver import agents
from spark_share.driver.agents import AgentRoster, agent_of, one_host
from spark_share.driver.batches import BatchState
from spark_share.driver.policy import BatchPolicy
from spark_share.errors import BatchRefused, ProtocolError
from spark_share.options import parse_options
from spark_share.transport.protocol import Fetch, Hello


class FakeConn:
    def __init__(self, blob: bytes = b""):
        self.info: dict = {}
        self.sent: list[dict] = []
        self.blob = blob
        self.closed = threading.Event()

    def call_async(self, header: dict) -> Future:
        self.sent.append(header)
        if header["op"] == "shutdown":
            self.closed.set()
        f: Future = Future()
        f.set_result(({"rows": 2}, self.blob) if header["op"] == "fetch" else ({"ok": True}, b""))
        return f

    def wait_closed(self, timeout=None) -> bool:
        return self.closed.wait(timeout)

    def set_keepalive(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s


@pytest.fixture
def roster(monkeypatch):
    monkeypatch.delenv("SPARK_SHARE_MASTER", raising=False)
    opts = parse_options({"kafka.bootstrap.servers": "b:9092", "kafka.group.id": "g", "subscribe": "t",
                          "kafka.sasl.password": "hunter2-secret"})
    return AgentRoster(opts, BatchPolicy(2, idle_probe_ms=1000), threading.RLock())


def test_a_joining_agent_is_told_what_to_read_and_no_credential(roster):
    conn = FakeConn()
    reply = roster.joined(conn, Hello("a1", "host-1", 42), latest=None)
    assert roster.conns == {"a1": conn} and agent_of(conn) == "a1" and conn.info["host"] == "host-1"
    assert reply["topics"] == ["t"] and reply["slots"] == 2
    # Both ends take the other for gone after the same silence: within the record lock (Kafka's default
    # 30 s as far as the tracker knows), never less than DEAD_AFTER_MIN_S.
    assert reply["dead_after_s"] == conn.dead_after_s == 10.0
    assert "hunter2-secret" not in repr(reply)
    assert not any("sasl" in k or "password" in k for k in reply)


def test_a_request_before_hello_is_refused():
    with pytest.raises(ProtocolError, match="did not say hello"):
        agent_of(FakeConn())


def test_a_batch_planned_before_the_agent_joined_starts_polling_when_it_joins(roster):
    conn = FakeConn()
    roster.joined(conn, Hello("a1", "h", 1), latest=BatchState(3, 2, None))
    assert [h["op"] for h in conn.sent] == ["prefetch"] and conn.sent[0]["batch"] == 3


def test_no_prefetch_on_a_cluster(roster, monkeypatch):
    monkeypatch.setenv("SPARK_SHARE_MASTER", "spark://master:7077")
    assert not one_host()
    conn = FakeConn()
    reply = roster.joined(conn, Hello("a1", "h", 1), latest=BatchState(3, 2, None))
    assert conn.sent == [] and reply["slots"] == 1


def test_a_reread_is_relayed_to_the_holder_and_counted(roster):
    holder = FakeConn(blob=b"arrow-ipc")
    roster.joined(holder, Hello("a1", "h1", 1), latest=None)
    assert roster.relay(Fetch(0, 1), "a1").result(timeout=5) == ({"rows": 2}, b"arrow-ipc")
    assert roster.relays == 1 and roster.relayed_bytes == len(b"arrow-ipc")
    with pytest.raises(BatchRefused, match="held by no live agent"):
        roster.relay(Fetch(0, 1), "gone")


def test_a_relayed_read_the_holder_never_answers_fails_on_its_own(roster, monkeypatch):
    """The relay holds no thread while the holder reads: an agent that never answers fails the read
    after RELAY_TIMEOUT_S, naming it, rather than a thread waiting."""
    monkeypatch.setattr(agents, "RELAY_TIMEOUT_S", 0.2)
    hung = FakeConn()
    hung.call_async = lambda header: Future()  # type: ignore[method-assign]  # never answered
    roster.joined(hung, Hello("a1", "h1", 1), latest=None)
    answer = roster.relay(Fetch(3, 1), "a1")
    assert not answer.done(), "the relay returned before the holder answered: nobody waits for it"
    with pytest.raises(TimeoutError, match="batch 3 slot 1: agent a1 did not answer"):
        answer.result(timeout=10)
    assert roster.relays == 0


def test_an_agent_leaving_is_forgotten_but_not_its_successor(roster):
    old, new = FakeConn(), FakeConn()
    roster.joined(old, Hello("a1", "h", 1), latest=None)
    roster.joined(new, Hello("a1", "h", 1), latest=None)  # the same id reconnected
    roster.left(old, stopping=False)
    assert roster.conns == {"a1": new}
    roster.left(new, stopping=False)
    assert roster.conns == {}
    roster.left(FakeConn(), stopping=False)  # never said hello: nothing to forget


def test_hosts_count_agents_members_and_slots(roster):
    a, b, c = FakeConn(), FakeConn(), FakeConn()
    for conn, (agent, host) in zip((a, b, c), [("a1", "h1"), ("a2", "h1"), ("a3", "h2")]):
        roster.joined(conn, Hello(agent, host, 1), latest=None)
    assert roster.members.total == 6, "one host (local mode): each joined with both slots' consumers"
    roster.members.closed("a2", 2)  # as their answers to a Trim say
    roster.members.closed("a3", 1)
    assert roster.hosts(["a1", "a3", "a3"]) == {"h1": {"agents": 2, "members": 2, "slots": 1},
                                                "h2": {"agents": 1, "members": 1, "slots": 2}}
    roster.left(b, stopping=False)
    assert roster.members.hosts() == {"h1": 2, "h2": 1} and roster.members.total == 3


def test_stop_all_asks_every_agent_and_waits_bounded(roster):
    conns = [FakeConn(), FakeConn()]
    for i, conn in enumerate(conns):
        roster.joined(conn, Hello(f"a{i}", "h", 1), latest=None)
    roster.stop_all(wait_s=5)
    assert all(conn.sent[-1]["op"] == "shutdown" and conn.closed.is_set() for conn in conns)
