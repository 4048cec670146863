"""The share-group members of one query run (its agents' share consumers), kept under a cap.

Owns: how many members each agent has (what it last reported), the members granted to reads and not
yet reported (``leases``), the cap (``numPartitions``, lowered to what the group admitted once the
broker refused a member for ``group.share.max.size``), the decision whether a read that finds no free
consumer on its host may open one (or which other agent must first close one it did not use in this
batch, or which agent with a consumer free in this batch reads the slot for it: ``lend``), which agents hold
members they have not used for a while (closed within a record lock), and the per-host view of status()
and progress.

Kafka caps a share group's members (``group.share.max.size``: 200 by default, at most 1,000; a second
query on the group counts too). A host opens a consumer when a read of its finds none free, and Spark
places a batch's tasks wherever it likes, so without a cap the members would be the sum over hosts of
the most slots each ever read at once. With the cap they are at most ``numPartitions`` at any time:
a batch has that many slots and a consumer serves one slot per batch, so some member is free in every
batch a read on a host without one finds the cap reached: that member's agent reads the slot and the
rows reach the read through the tracker. Members do not move between hosts per batch (a consumer that
joins waits for its assignment, on Kafka up to a heartbeat, and on the embedded broker every join ends
every member's share session); a host's members that no read used for a while are closed, and the
next read past the cap opens one where reads land.

Must never: do I/O or wait (the tracker asks the agents and calls this under the ledger's lock), or
let granted and reported members together pass the cap.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

# A member no read used in this many batches in a row, for half a record lock, is closed: a host that
# stops reading gives its consumers back to the group (their partitions go to members that are polled).
IDLE_BATCHES = 2


@dataclass
class AgentMembers:
    host: str
    members: int = 0  # as the agent last reported
    used: dict[int, set[str]] = field(default_factory=dict)  # batch -> its sessions that polled in it
    busy: dict[int, set[int]] = field(default_factory=dict)  # batch -> slots its consumers read (claimed or lent)
    last_read: tuple[int, float] = (-1, 0.0)  # (batch, time) of its last claim
    trim_asked_at: float = 0.0


class MemberBook:
    """Counts members by the events the tracker itself sees, never by an agent's report of its total (two
    reads of one agent report out of order: a total sent before a member opened, arriving after, would
    undercount and let the cap be passed): an agent joins with the consumers the tracker told it to start,
    a granted member is a lease until the read that opened it says so, a consumer an agent closes is one
    the tracker asked it to close (its answer says how many), a refused one is dropped."""

    def __init__(self, cap: int):
        self.cap = cap
        self.wanted = cap  # what the query asked for (numPartitions), for the refusal's message
        self.agents: dict[str, AgentMembers] = {}
        self.leases: dict[tuple[int, int], str] = {}  # (batch, slot) -> agent granted a new member
        self.refused = 0  # members the group refused (group.share.max.size)

    @property
    def total(self) -> int:
        return sum(a.members for a in self.agents.values()) + len(self.leases)

    def joined(self, agent: str, host: str, members: int) -> None:
        self.agents[agent] = AgentMembers(host, members)

    def left(self, agent: str) -> None:
        self.agents.pop(agent, None)
        for key in [k for k, a in self.leases.items() if a == agent]:
            del self.leases[key]

    def read(self, agent: str, batch: int, slot: int, session: str | None, opened: bool) -> None:
        """A read of (batch, slot) on ``agent`` polled with ``session``, which it ``opened`` on a lease."""
        a = self.agents.get(agent)
        if a is None:
            return
        if opened and self.leases.pop((batch, slot), None) is not None:
            a.members += 1
        if session:
            a.used.setdefault(batch, set()).add(session)
            for old in [b for b in a.used if b < batch - 4 * IDLE_BATCHES]:
                del a.used[old]

    def closed(self, agent: str, n: int) -> None:
        """``agent`` closed ``n`` consumers the tracker asked it to close."""
        a = self.agents.get(agent)
        if a is not None:
            a.members = max(0, a.members - n)

    def settled(self, batch: int) -> None:
        """``batch`` is acknowledged: a member leased to one of its reads that never said whether it opened
        it (the read failed) counts as a member from now on (counting one too many keeps the cap; the
        agent's next answer to a Trim says how many it has)."""
        for key in [k for k in self.leases if k[0] <= batch]:
            a = self.agents.get(self.leases.pop(key))
            if a is not None:
                a.members += 1

    def claimed(self, agent: str, batch: int, slot: int) -> None:
        """``agent``'s consumers read (batch, slot): a read of its own, or one lent to it."""
        a = self.agents.get(agent)
        if a is not None:
            a.last_read = (max(batch, a.last_read[0]), time.monotonic())
            a.busy.setdefault(batch, set()).add(slot)
            for old in [b for b in a.busy if b < batch - 4 * IDLE_BATCHES]:
                del a.busy[old]

    def _free(self, name: str, a: AgentMembers, batch: int) -> int:
        """``a``'s members that no read of ``batch`` uses (a slot that opened a member on a lease uses that one)."""
        busy = a.busy.get(batch, ())
        return a.members - sum(1 for s in busy if self.leases.get((batch, s)) != name)

    def may_open(self, agent: str, batch: int, slot: int) -> bool:
        """A read of (batch, slot) on ``agent`` found no free member: may it open one now? If so the
        member is leased to it until the read says it opened it."""
        if self.total < self.cap:
            self.leases[(batch, slot)] = agent
            return True
        return False

    def lend(self, agent: str, batch: int, slot: int) -> str | None:
        """The cap is reached and ``agent`` has no free member for its read of (batch, slot): the agent that
        reads the slot for it, one with more members than its reads of this batch use (the least recently
        read first), or None (every member is in use: the cap was lowered by a refusal)."""
        free = [(a.last_read, name) for name, a in self.agents.items()
                if name != agent and self._free(name, a, batch) > 0]
        if not free:
            return None
        helper = min(free)[1]
        asking = self.agents.get(agent)
        if asking is not None:
            asking.busy.get(batch, set()).discard(slot)
        self.claimed(helper, batch, slot)
        return helper

    def idle(self, batch: int, idle_s: float) -> list[str]:
        """Agents holding members that no read used in the last IDLE_BATCHES batches up to ``batch`` (each
        asked at most every ``idle_s / 2``): they close those that have not polled for ``idle_s``."""
        now = time.monotonic()
        out = []
        for name, a in self.agents.items():
            recent = set().union(*(a.used.get(b, set()) for b in range(batch - IDLE_BATCHES + 1, batch + 1)))
            if a.members > len(recent) and now - a.trim_asked_at >= idle_s / 2:
                a.trim_asked_at = now
                out.append(name)
        return out

    def refuse(self, agent: str, batch: int, slot: int) -> bool:
        """The group refused the member a read of (batch, slot) on ``agent`` polled with (one it opened on a
        lease, or one it started when it joined): the agent dropped it, and the cap becomes what the group
        admitted. False when it admitted none of this query's members at all."""
        if self.leases.pop((batch, slot), None) is None:
            a = self.agents.get(agent)
            if a is not None:
                a.members = max(0, a.members - 1)
        self.refused += 1
        if not self.total:
            return False
        self.cap = min(self.cap, self.total)
        return True

    def hosts(self) -> dict[str, int]:
        """Members per host."""
        out: dict[str, int] = {}
        for a in self.agents.values():
            out[a.host] = out.get(a.host, 0) + a.members
        return out

    def view(self, top: int = 20) -> dict:
        """For progress (``top`` hosts with the most members) and status() (every host)."""
        hosts = self.hosts()
        shown = dict(sorted(hosts.items(), key=lambda kv: (-kv[1], kv[0]))[:top])
        return {"members": self.total, "memberLimit": self.cap, "membersWanted": self.wanted,
                "membersRefused": self.refused, "membersPerHost": shown,
                "hostsWithMembers": sum(1 for n in hosts.values() if n)}
